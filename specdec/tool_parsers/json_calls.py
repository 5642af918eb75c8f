"""The JSON form of tool calls that any model can be made to write (vLLM's form for
``tool_choice`` "required" and a named tool, whatever the chat template)::

    [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]

and, for a named tool, the bare arguments object ``{"city": "Paris"}`` (the name is the
request's). The grammar (grammar.py ``json_calls_grammar``) guarantees the shape; these parsers
read it back, whole or streamed, and an output cut short (``max_tokens``) keeps the calls it
completed.
"""
from __future__ import annotations

from specdec.tool_parsers.base import (
    ParsedOutput,
    ToolCall,
    ToolParser,
    escape_controls,
    parse_call_object,
    partial_call_object,
)

ARGUMENTS_KEY = "parameters"
CALL_SEPARATOR = ", "
_KEYS = ("parameters", "arguments")
_WHITESPACE = " \t\r\n"


class JsonCallsToolParser(ToolParser):
    name = "json_calls"

    def scan(self, text: str, final: bool) -> ParsedOutput:
        stripped = text.lstrip(_WHITESPACE)
        if not stripped:
            return ParsedOutput(None)
        if not stripped.startswith("["):
            return ParsedOutput(text.strip() or None)
        calls: list[ToolCall] = []
        pos = len(text) - len(stripped) + 1
        while True:
            call, after = parse_call_object(text, pos, _KEYS)
            if call is None:
                partial = None if final else partial_call_object(text, pos, _KEYS)
                if partial is not None:
                    calls.append(partial)
                if final and not calls:
                    return ParsedOutput(text.strip() or None)
                return ParsedOutput(None, calls)
            calls.append(call)
            rest = text[after:].lstrip(_WHITESPACE)
            if not rest.startswith(","):
                return ParsedOutput(None, calls)  # "]", or cut short after a complete call
            pos = len(text) - len(rest) + 1


class NamedToolCallParser(ToolParser):
    """The output is the arguments of the one function the request named."""

    def __init__(self, function_name: str):
        self.function_name = function_name
        self.name = f"named:{function_name}"

    def scan(self, text: str, final: bool) -> ParsedOutput:
        # leading and trailing whitespace lie outside the object (held back until the end)
        arguments = escape_controls(text.strip(_WHITESPACE))
        if not arguments:
            return ParsedOutput(None)
        return ParsedOutput(None, [ToolCall(self.function_name, arguments, complete=final)])
