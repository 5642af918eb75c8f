"""DeepSeek-V3 / R1-0528 tool calls (their chat templates), after any text::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

one ``<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>`` per call; DeepSeek-V3.1's shorter call
``<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>`` is read
too. A call whose arguments are not a JSON object makes the whole output content. The markers
are added tokens; requests read by this parser keep special tokens in their text.
"""
from __future__ import annotations

from specdec.tool_parsers.base import JSON_DECODER, ParsedOutput, ToolCall, ToolParser, escape_controls, held_back_prefix

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE_OPEN, FENCE_CLOSE = "```json", "```"
_WHITESPACE = " \t\r\n"


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"
    skip_special_tokens = False

    def scan(self, text: str, final: bool) -> ParsedOutput:
        start = text.find(CALLS_BEGIN)
        if start < 0:
            content = text if final else text[:len(text) - held_back_prefix(text, CALLS_BEGIN)]
            return ParsedOutput(content.strip() or None)
        content = text[:start].strip() or None
        calls: list[ToolCall] = []
        pos = start + len(CALLS_BEGIN)
        while True:
            rest = text[pos:].lstrip(_WHITESPACE)
            if not rest.startswith(CALL_BEGIN):  # no further call
                if final and (not calls or not (rest == "" or rest.startswith(CALLS_END))):
                    return ParsedOutput(text.strip() or None)
                return ParsedOutput(content, calls)
            body = len(text) - len(rest) + len(CALL_BEGIN)
            end = text.find(CALL_END, body)
            closed = end >= 0 or final
            call = _call(text[body:end if end >= 0 else len(text)], complete=closed)
            if call is None:  # malformed: content as a whole (a stream keeps what it sent)
                return ParsedOutput(text.strip() or None) if final else ParsedOutput(content, calls)
            calls.append(call)
            if end < 0:
                return ParsedOutput(content, calls)
            pos = end + len(CALL_END)


def _call(inner: str, complete: bool) -> ToolCall | None:
    """One call's text (between the call markers); a partial one while ``complete`` is False."""
    head, sep, after = inner.partition(SEP)
    if not sep:
        return None
    if head.strip(_WHITESPACE) == "function":  # V3: name, newline, fenced JSON
        name, newline, fenced = after.partition("\n")
        if not newline:
            return None
        fenced = fenced.lstrip(_WHITESPACE)
        if not fenced.startswith(FENCE_OPEN):
            return None if complete or not FENCE_OPEN.startswith(fenced) else ToolCall(name.strip(), "", False)
        args = fenced[len(FENCE_OPEN):]
        close = args.rfind(FENCE_CLOSE)
        if complete:
            if close < 0 or args[close + len(FENCE_CLOSE):].strip(_WHITESPACE):
                return None
            args = args[:close]
        elif close >= 0:
            args = args[:close]
        else:
            args = args[:len(args) - held_back_prefix(args, FENCE_CLOSE)]
    else:  # V3.1: name, then the JSON object
        name, args = head, after
        if not complete:
            args = args[:len(args) - held_back_prefix(args, CALL_END)]
    name = name.strip(_WHITESPACE)
    args = args.strip(_WHITESPACE)
    if not name:
        return None
    if not complete:
        return ToolCall(name, escape_controls(args), complete=False) if not args or args.startswith("{") else None
    try:
        obj, end = JSON_DECODER.raw_decode(args)
    except ValueError:
        return None
    if not isinstance(obj, dict) or args[end:].strip(_WHITESPACE):
        return None
    return ToolCall(name, escape_controls(args))
