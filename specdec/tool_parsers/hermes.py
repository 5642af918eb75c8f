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
    ToolParser,
    held_back_prefix,
    parse_call_object,
    partial_call_object,
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
        content: list[str] = []
        calls = []
        pos = 0
        while True:
            start = text.find(OPEN, pos)
            if start < 0:
                tail = text[pos:]
                content.append(tail if final else tail[:len(tail) - held_back_prefix(tail, OPEN)])
                break
            content.append(text[pos:start])
            body = start + len(OPEN)
            close = text.find(CLOSE, body)
            end = close if close >= 0 else len(text)
            call, after = parse_call_object(text[:end], body, _KEYS)
            if call is not None and text[after:end].strip() == "":
                calls.append(call)
            elif close >= 0 or final:
                content.append(text[start:end + (len(CLOSE) if close >= 0 else 0)])
            else:  # an open tag still being written; its close tag may be starting
                partial = partial_call_object(text[:end - held_back_prefix(text[:end], CLOSE)], body, _KEYS)
                if partial is not None:
                    calls.append(partial)
                break
            if close < 0:
                break
            pos = close + len(CLOSE)
        return ParsedOutput("".join(content).strip() or None, calls)
