"""Pythonic tool calls (Llama 4, Llama 3.2 with its pythonic template, ToolACE): the whole
output is a Python list of calls with keyword arguments, optionally between Llama 4's
``<|python_start|>`` and ``<|python_end|>``::

    [get_weather(city="San Francisco", unit="celsius"), get_time(timezone="UTC")]

Argument values are Python literals (``True``, ``None``, tuples...), returned as JSON. An
output that is not such a list, as a whole, is content. A stream announces each call once it
is complete (its closing parenthesis written), with its whole arguments.
"""
from __future__ import annotations

import ast
import json

from specdec.tool_parsers.base import ParsedOutput, ToolCall, ToolParser

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
MAX_PREFIX_PARSES = 16  # per streamed scan: text with many ")" that never parses is not re-parsed endlessly


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def scan(self, text: str, final: bool) -> ParsedOutput:
        body = text.strip()
        if body.startswith(PYTHON_START):
            body = body[len(PYTHON_START):].lstrip()
        elif not final and body and PYTHON_START.startswith(body):
            return ParsedOutput(None)
        if body.endswith(PYTHON_END):
            body = body[:-len(PYTHON_END)].rstrip()
        if not body.startswith("["):
            return ParsedOutput(text.strip() or None) if body or final else ParsedOutput(None)
        if final:
            calls = parse_call_list(body)
            return ParsedOutput(None, calls) if calls else ParsedOutput(text.strip() or None)
        return ParsedOutput(None, _complete_calls(body))


def parse_call_list(source: str) -> list[ToolCall] | None:
    """``[f(a=1), g()]`` -> its calls; None unless it is a non-empty list of calls with keyword
    arguments whose values are literals."""
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        name = _dotted_name(node.func) if isinstance(node, ast.Call) else None
        if name is None or node.args or any(kw.arg is None for kw in node.keywords):
            return None
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False)))
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
    return calls


def _complete_calls(body: str) -> list[ToolCall]:
    """The calls of an unfinished list that are complete: the longest prefix that ends a call
    (a ``)`` followed by ``,`` or nothing) and parses once the list is closed."""
    end = len(body)
    for _ in range(MAX_PREFIX_PARSES):
        close = body.rfind(")", 0, end)
        if close < 0:
            return []
        after = body[close + 1:].lstrip()
        if after == "" or after.startswith(","):
            calls = parse_call_list(body[:close + 1] + "]")
            if calls is not None:
                return calls
        end = close
    return []


def _dotted_name(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted_name(node.value)
        return f"{base}.{node.attr}" if base else None
    return None
