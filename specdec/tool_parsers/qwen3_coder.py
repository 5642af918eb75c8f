"""Qwen3-Coder's XML tool calls (Qwen3-Coder-30B-A3B / 480B-A35B chat templates)::

    Let me check.
    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Parameter values are written bare, so their JSON types come from the request's tool schemas
(``for_tools``): a ``string`` parameter (or one the schema does not list) stays text, the
others are read as JSON (Python literals for objects and arrays as a fallback) and stay text
where they do not parse. One newline after the opening tag and before the closing one belongs
to the markup. A streamed call's arguments grow one complete parameter at a time.
"""
from __future__ import annotations

import ast
import json
import re

from specdec.tool_parsers.base import ParsedOutput, ToolCall, ToolParser, scan_tagged

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_END = "</function>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"

    def __init__(self, parameter_types: dict[str, dict[str, object]] | None = None):
        self.parameter_types = parameter_types or {}  # function -> parameter -> JSON-schema "type"

    def for_tools(self, functions: list[dict]) -> ToolParser:
        types = {}
        for fn in functions:
            properties = (fn.get("parameters") or {}).get("properties") or {}
            types[fn["name"]] = {k: v.get("type") for k, v in properties.items() if isinstance(v, dict)}
        return Qwen3CoderToolParser(types)

    def scan(self, text: str, final: bool) -> ParsedOutput:
        def complete(text: str, body: int, end: int) -> ToolCall | None:
            call = self._call(text[body:end])
            return call if call is not None and call.complete else None

        return scan_tagged(text, final, OPEN, CLOSE, complete, lambda text, body, end: self._call(text[body:end]))

    def _call(self, inner: str) -> ToolCall | None:
        """The call in one tag's text: complete once ``</function>`` closes it; None if malformed
        (or its name is not written yet)."""
        m = _FUNCTION.match(inner)
        if m is None:
            return None
        name = m.group(1).strip()
        close = inner.find(FUNCTION_END, m.end())
        region = inner[m.end():close if close >= 0 else len(inner)]
        pairs, pos = [], 0
        for p in _PARAMETER.finditer(region):
            if p.start() != pos:
                return None
            pairs.append((p.group(1).strip(), p.group(2)))
            pos = p.end()
        complete = close >= 0
        if complete and (region[pos:].strip() or inner[close + len(FUNCTION_END):].strip()):
            return None
        types = self.parameter_types.get(name, {})
        fields = [f"{json.dumps(k, ensure_ascii=False)}: {_json_value(_unwrap(v), types.get(k))}" for k, v in pairs]
        return ToolCall(name, "{" + ", ".join(fields) + ("}" if complete else ""), complete=complete)


def _unwrap(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    return value[:-1] if value.endswith("\n") else value


def _json_value(value: str, schema_type) -> str:
    types = set(schema_type) if isinstance(schema_type, list) else {schema_type}
    if not types - {None, "string"}:
        return json.dumps(value, ensure_ascii=False)
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = _literal(value) if types & {"object", "array"} else None
        if parsed is None and value.strip() != "null":
            return json.dumps(value, ensure_ascii=False)
    return json.dumps(parsed, ensure_ascii=False)


def _literal(value: str):
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    return parsed if isinstance(parsed, (dict, list)) else None
