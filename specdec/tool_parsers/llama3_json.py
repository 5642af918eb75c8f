"""Llama 3.x JSON tool calls (Llama 3.1 / 3.2 / 3.3 chat templates): the whole output is one
call object, or several separated by ``;``, optionally after ``<|python_tag|>``::

    {"name": "get_weather", "parameters": {"city": "Paris"}}

An output that is not entirely calls is content, as a whole.
"""
from __future__ import annotations

import json

from specdec.tool_parsers.base import ParsedOutput, ToolParser, parse_call_object, partial_call_object

PYTHON_TAG = "<|python_tag|>"
_KEYS = ("parameters", "arguments")


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    separator = "; "
    native_grammar = True

    def call_begin(self, name: str) -> str:
        return f'{{"name": {json.dumps(name)}, "parameters": '

    def call_end(self) -> str:
        return "}"

    def scan(self, text: str, final: bool) -> ParsedOutput:
        stripped = text.lstrip()
        start = len(text) - len(stripped)
        if stripped.startswith(PYTHON_TAG):
            start += len(PYTHON_TAG)
        elif not stripped.startswith("{"):
            if not final and PYTHON_TAG.startswith(stripped):
                return ParsedOutput(None)  # the tag may be starting
            return ParsedOutput(text.strip() or None)
        calls = []
        pos = start
        while True:
            if final and calls and not text[pos:].strip():
                return ParsedOutput(None, calls)  # a trailing ";"
            call, after = parse_call_object(text, pos, _KEYS)
            if call is None:
                if final:
                    return ParsedOutput(text.strip() or None)
                partial = partial_call_object(text, pos, _KEYS)
                if partial is not None:
                    calls.append(partial)
                elif not _may_be_call(text, pos) and not calls:
                    return ParsedOutput(text.strip() or None)
                return ParsedOutput(None, calls)
            calls.append(call)
            i = after
            while i < len(text) and text[i] in " \t\r\n":
                i += 1
            if i == len(text):
                return ParsedOutput(None, calls)
            if text[i] != ";":
                # not a list of calls: content as a whole (a stream that sent a call sends no more)
                return ParsedOutput(text.strip() or None) if final else ParsedOutput(None, calls)
            pos = i + 1


def _may_be_call(text: str, pos: int) -> bool:
    """Could more text still make ``text[pos:]`` a call object (it opens with ``{``, or is blank)?"""
    rest = text[pos:].lstrip()
    return rest == "" or rest.startswith("{")
