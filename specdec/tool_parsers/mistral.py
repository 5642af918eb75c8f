"""Mistral tool calls (Mistral 7B v0.3, Mixtral 8x22B, Mistral Small / Nemo / Large): text,
then ``[TOOL_CALLS]`` and a JSON array of calls (tokenizer v3 / v7)::

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]

or, from tokenizer v11 on, one ``[TOOL_CALLS]name[ARGS]{arguments}`` per call::

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

``[TOOL_CALLS]`` and ``[ARGS]`` are special tokens, so requests read by this parser keep
special tokens in their text. What follows ``[TOOL_CALLS]`` that is not valid calls stays
content, as a whole.
"""
from __future__ import annotations

from specdec.tool_parsers.base import (
    JSON_DECODER,
    ParsedOutput,
    ToolCall,
    ToolParser,
    escape_controls,
    held_back_prefix,
)
from specdec.tool_parsers.json_calls import JsonCallsToolParser

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_WHITESPACE = " \t\r\n"


class MistralToolParser(ToolParser):
    name = "mistral"
    skip_special_tokens = False

    def scan(self, text: str, final: bool) -> ParsedOutput:
        start = text.find(TOOL_CALLS)
        if start < 0:
            content = text if final else text[:len(text) - held_back_prefix(text, TOOL_CALLS)]
            return ParsedOutput(content.strip() or None)
        content = text[:start].strip() or None
        body = text[start + len(TOOL_CALLS):]
        if body.lstrip(_WHITESPACE).startswith("[") or (not final and not body.strip(_WHITESPACE)):
            calls = JsonCallsToolParser().scan(body, final)
            if calls.content is not None:
                return ParsedOutput(text.strip() or None)
            return ParsedOutput(content, calls.tool_calls)
        calls = _name_args_calls(body, final)
        if calls is None:
            return ParsedOutput(text.strip() or None) if final else ParsedOutput(content)
        return ParsedOutput(content, calls)


def _name_args_calls(body: str, final: bool) -> list[ToolCall] | None:
    """``name[ARGS]{...}`` calls separated by ``[TOOL_CALLS]``; None where the text is not such
    calls (yet: a name being written is not announced)."""
    calls: list[ToolCall] = []
    for part in body.split(TOOL_CALLS):
        name, sep, args = part.partition(ARGS)
        name = name.strip(_WHITESPACE)
        if not sep:
            return None if final else (calls or None)
        if not name or any(c in name for c in " {}[]\"'"):
            return None
        args = args.strip(_WHITESPACE) if final else args.lstrip(_WHITESPACE)
        if not final:
            args = args[:len(args) - held_back_prefix(args, TOOL_CALLS)].rstrip(_WHITESPACE)
        try:
            obj, end = JSON_DECODER.raw_decode(args) if args else (None, 0)
        except ValueError:
            obj, end = None, 0
        if isinstance(obj, dict) and not args[end:].strip(_WHITESPACE):
            calls.append(ToolCall(name, escape_controls(args[:end])))
        elif final or (args and not args.startswith("{")):
            return None
        else:
            calls.append(ToolCall(name, escape_controls(args), complete=False))
    return calls
