"""Hermes-style tool calls (Qwen2.5, Qwen3, Hermes 2/3 and their chat templates)::

    any text
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Zero or more calls, each in its own tag pair; the text outside them is the content. A tag
left open at the end of the output still counts if its JSON is complete (the output ran
into ``max_tokens`` or a stop string right after the object).
"""
from __future__ import annotations

import json

from specdec.tool_parsers.base import (
    ParsedOutput,
    ToolCall,
    ToolParser,
    held_back_prefix,
    parse_call_object,
    partial_call_object,
    scan_tagged,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_KEYS = ("arguments", "parameters")


class HermesToolParser(ToolParser):
    name = "hermes"
    separator = "\n"
    native_grammar = True

    def call_begin(self, name: str) -> str:
        return f'{OPEN}\n{{"name": {json.dumps(name)}, "arguments": '

    def call_end(self) -> str:
        return f"}}\n{CLOSE}"

    def scan(self, text: str, final: bool) -> ParsedOutput:
        def complete(text: str, body: int, end: int) -> ToolCall | None:
            call, after = parse_call_object(text[:end], body, _KEYS)
            return call if call is not None and text[after:end].strip() == "" else None

        def partial(text: str, body: int, end: int) -> ToolCall | None:  # its close tag may be starting
            return partial_call_object(text[:end - held_back_prefix(text[:end], CLOSE)], body, _KEYS)

        return scan_tagged(text, final, OPEN, CLOSE, complete, partial)
