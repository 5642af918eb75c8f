"""ToolParser: a model's tool-call format -> OpenAI ``tool_calls``, whole or streamed.

A parser has one function, ``scan(text, final)``: the content and the calls a (possibly
partial) output holds so far. ``final=False`` shows only what cannot change as more text
arrives: a tag that may be starting is held back, so is trailing whitespace, and a call
appears once its name is known, with the prefix of its arguments written so far. The whole
output (``parse``) and the stream (``ToolCallStream``, the difference of successive scans)
therefore agree: the streamed content and argument fragments concatenate to what ``parse``
returns. Text in a tool-call tag that is not a valid call stays content.

A call's ``arguments`` is the model's own JSON text for the arguments object (so a stream can
send it as it is written), with raw control characters inside strings escaped (JSON forbids
them, and grammars for length-bounded strings let them through); ``parse`` falls back to
``json.dumps`` only when the model wrote the keys in an order the streaming scan cannot follow.
"""
from __future__ import annotations

import functools
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

_DECODER = json.JSONDecoder(strict=False)  # control characters in strings: see escape_controls
JSON_DECODER = _DECODER


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object; in a partial scan, a prefix of it
    complete: bool = True

    def as_openai(self, call_id: str) -> dict:
        return {"id": call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedOutput:
    content: str | None  # the text outside the calls, stripped; None when there is none
    tool_calls: list[ToolCall] = field(default_factory=list)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolParser:
    """One model family's tool-call format. Subclasses set ``name`` and implement ``scan``;
    formats whose calls are literal text around a JSON arguments object also implement
    ``call_begin`` / ``call_end`` / ``separator`` and set ``native_grammar`` (then "required"
    and a named tool are enforced in the model's own format; otherwise in the JSON form of
    json_calls.py, which any model can write)."""

    name: str = ""
    separator: str = ""
    native_grammar: bool = False
    # False: the format's markers are special tokens, so the output text must keep them
    skip_special_tokens: bool = True

    def for_tools(self, functions: list[dict]) -> ToolParser:
        """The parser for one request's tools (OpenAI function definitions); formats that write
        argument values untyped read their types from the tools' schemas."""
        return self

    def scan(self, text: str, final: bool) -> ParsedOutput:
        raise NotImplementedError

    def parse(self, text: str) -> ParsedOutput:
        return self.scan(text, final=True)

    def call_begin(self, name: str) -> str:
        raise NotImplementedError

    def call_end(self) -> str:
        raise NotImplementedError


def held_back_prefix(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@functools.lru_cache(maxsize=None)
def scan_tagged(text: str, final: bool, open_tag: str, close_tag: str,
                complete: Callable[[str, int, int], ToolCall | None],
                partial: Callable[[str, int, int], ToolCall | None]) -> ParsedOutput:
    """The content and calls of a format that wraps each call in ``open_tag`` ... ``close_tag``.
    ``complete(text, body, end)``: the finished call between ``body`` and ``end``, else None;
    ``partial(text, body, end)``: the call so far of a tag still being written (streaming). A
    malformed tag stays in the content; an opening tag that may still be arriving is held back."""
    content: list[str] = []
    calls = []
    pos = 0
    while True:
        start = text.find(open_tag, pos)
        if start < 0:
            tail = text[pos:]
            content.append(tail if final else tail[:len(tail) - held_back_prefix(tail, open_tag)])
            break
        content.append(text[pos:start])
        body = start + len(open_tag)
        close = text.find(close_tag, body)
        end = close if close >= 0 else len(text)
        call = complete(text, body, end)
        if call is not None:
            calls.append(call)
        elif close >= 0 or final:
            content.append(text[start:end + (len(close_tag) if close >= 0 else 0)])
        else:  # still being written
            call = partial(text, body, end)
            if call is not None:
                calls.append(call)
            break
        if close < 0:
            break
        pos = close + len(close_tag)
    return ParsedOutput("".join(content).strip() or None, calls)


def _header(keys: tuple[str, ...]) -> re.Pattern:
    alternatives = "|".join(re.escape(k) for k in keys)
    return re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:' + alternatives + r')"\s*:\s*')


def parse_call_object(text: str, start: int, keys: tuple[str, ...]) -> tuple[ToolCall | None, int]:
    """A complete call object ``{"name": ..., "<key>": {...}}`` at ``text[start:]`` (after
    whitespace) -> (the call, the index after it), or (None, start) if there is none."""
    i = _skip_ws(text, start)
    try:
        obj, end = _DECODER.raw_decode(text, i)
    except ValueError:
        return None, start
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None, start
    key = next((k for k in keys if k in obj), None)
    if key is None or not set(obj) <= {"name", key}:
        return None, start
    args = obj[key]
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            if isinstance(_DECODER.decode(args), dict):
                return ToolCall(obj["name"], escape_controls(args)), end
        except ValueError:
            pass
        return None, start
    if not isinstance(args, dict):
        return None, start
    raw = _raw_arguments(text, i, keys)
    if raw is not None and _DECODER.decode(raw) == args:
        return ToolCall(obj["name"], escape_controls(raw)), end
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False)), end


def partial_call_object(text: str, start: int, keys: tuple[str, ...]) -> ToolCall | None:
    """An unfinished call object at ``text[start:]``: its name and the arguments written so far,
    once the name and the arguments key have been written (name first); else None."""
    m = _header(keys).match(text, start)
    if m is None:
        return None
    name = _unescape(m.group(1))
    args_start = m.end()
    if args_start >= len(text):
        return ToolCall(name, "", complete=False) if name else None
    if text[args_start] != "{":
        return None  # not an object (yet): nothing safe to stream
    try:
        _, end = _DECODER.raw_decode(text, args_start)
        return ToolCall(name, escape_controls(text[args_start:end]), complete=False)
    except ValueError:  # unfinished: everything after the key is inside the arguments object
        return ToolCall(name, escape_controls(text[args_start:]), complete=False)


def _raw_arguments(text: str, start: int, keys: tuple[str, ...]) -> str | None:
    m = _header(keys).match(text, start)
    if m is None or m.end() >= len(text) or text[m.end()] != "{":
        return None
    try:
        _, end = _DECODER.raw_decode(text, m.end())
    except ValueError:
        return None
    return text[m.end():end]


def escape_controls(json_text: str) -> str:
    """``json_text`` with each control character inside a string written as ``\\u00XX``; a
    prefix maps to a prefix of the whole, so streamed fragments still concatenate."""
    if not any(c < " " for c in json_text):
        return json_text
    out, in_string, escaped = [], False, False
    for c in json_text:
        if in_string and c < " " and not escaped:
            out.append(f"\\u{ord(c):04x}")
            continue
        out.append(c)
        if escaped:
            escaped = False
        elif c == "\\" and in_string:
            escaped = True
        elif c == '"':
            in_string = not in_string
    return "".join(out)


def _unescape(s: str) -> str:
    try:
        return json.loads(f'"{s}"')
    except ValueError:
        return ""


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


class ToolCallStream:
    """One streamed choice: feed the cumulative text after each step, get the OpenAI delta
    fields that are new (``content`` and / or ``tool_calls``). What was sent is never
    retracted: a call announced and later found malformed keeps what it sent."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None):
        self.parser = parser
        self.max_calls = max_calls  # calls past this many are not sent
        self.sent_content = ""
        self.call_ids: list[str] = []
        self.sent_arguments: list[str] = []

    @property
    def num_calls(self) -> int:
        return len(self.call_ids)

    def update(self, text: str, final: bool) -> dict:
        snap = self.parser.scan(text, final)
        delta: dict = {}
        content = snap.content or ""
        if len(content) > len(self.sent_content) and content.startswith(self.sent_content):
            delta["content"] = content[len(self.sent_content):]
            self.sent_content = content
        calls = []
        for index, call in enumerate(snap.tool_calls[:self.max_calls]):
            if index == len(self.call_ids):
                self.call_ids.append(new_call_id())
                self.sent_arguments.append(call.arguments)
                calls.append({"index": index, "id": self.call_ids[index], "type": "function",
                              "function": {"name": call.name, "arguments": call.arguments}})
                continue
            sent = self.sent_arguments[index]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                calls.append({"index": index, "function": {"arguments": call.arguments[len(sent):]}})
                self.sent_arguments[index] = call.arguments
        if calls:
            delta["tool_calls"] = calls
        return delta
