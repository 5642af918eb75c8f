"""Tool-call parsers: whole outputs, and the same outputs streamed in every split, must give
the same content and calls; malformed calls stay content; nothing of the markup leaks into
streamed content."""
from __future__ import annotations

import json
import random

import pytest

from specdec.tool_parsers import ToolCallStream, get_tool_parser, parser_for_template

HERMES_CASES = [
    # (output, content, [(name, arguments as parsed JSON)])
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
     [("get_weather", {"city": "Paris"})]),
    ('Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": [1, {"y": "}"}]}}\n</tool_call>\n'
     '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>', "Let me check.",
     [("a", {"x": [1, {"y": "}"}]}), ("b", {})]),
    ('<tool_call>{"arguments": {"q": "r"}, "name": "late_name"}</tool_call>', None, [("late_name", {"q": "r"})]),
    ('<tool_call>\n{"name": "s", "arguments": "{\\"k\\": 1}"}\n</tool_call>', None, [("s", {"k": 1})]),
    ('<tool_call>\n{"name": "open", "arguments": {"a": 1}}', None, [("open", {"a": 1})]),  # cut before the close
    ('<tool_call>\n{"name": "ctl", "arguments": {"s": "a\x07b\tc"}}\n</tool_call>', None,
     [("ctl", {"s": "a\x07b\tc"})]),  # raw control characters in a string: escaped, valid JSON
    ("plain answer", "plain answer", []),
    ("a < b and <tool", "a < b and <tool", []),
    ('<tool_call>\n{"name": "bad", "arguments": {"a": }\n</tool_call> after',
     '<tool_call>\n{"name": "bad", "arguments": {"a": }\n</tool_call> after', []),  # malformed JSON: content
    ('<tool_call>\n{"nam": "bad"}\n</tool_call>', '<tool_call>\n{"nam": "bad"}\n</tool_call>', []),
    ('<tool_call>\n["not", "a", "call"]\n</tool_call>', '<tool_call>\n["not", "a", "call"]\n</tool_call>', []),
    ('<tool_call>\n{"name": "x", "arguments": {"a": 1}, "extra": 2}\n</tool_call>',
     '<tool_call>\n{"name": "x", "arguments": {"a": 1}, "extra": 2}\n</tool_call>', []),
    ('<tool_call>\n{"name": "x", "arguments": {"a": 1', '<tool_call>\n{"name": "x", "arguments": {"a": 1', []),
]

LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "f", "parameters": {"a": "b;c"}}; {"name": "g", "arguments": {}}', None,
     [("f", {"a": "b;c"}), ("g", {})]),
    ("The weather is fine.", "The weather is fine.", []),
    ('{"city": "Paris"}', '{"city": "Paris"}', []),  # JSON, but not a call
    ('{"name": "f", "parameters": {"a": 1}} and more', '{"name": "f", "parameters": {"a": 1}} and more', []),
    ('{"name": "f", "parameters": {"a": 1', '{"name": "f", "parameters": {"a": 1', []),
]


def check_parse(parser_name, text, content, calls):
    out = get_tool_parser(parser_name).parse(text)
    assert out.content == content
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == calls


@pytest.mark.parametrize("text,content,calls", HERMES_CASES)
def test_hermes_parse(text, content, calls):
    check_parse("hermes", text, content, calls)


@pytest.mark.parametrize("text,content,calls", LLAMA_CASES)
def test_llama3_json_parse(text, content, calls):
    check_parse("llama3_json", text, content, calls)


# the JSON of a call turns bad after its name and first arguments were streamed: a stream
# cannot take them back (the content still carries the text, as the whole parse does)
ANNOUNCED_THEN_MALFORMED = {case[0] for case in HERMES_CASES + LLAMA_CASES
                            if not case[2] and ('"name": "' in case[0])}


def stream(parser_name: str, text: str, cuts: list[int]) -> tuple[str, dict[int, dict]]:
    """Feed ``text`` growing to each cut, then whole and final; reassemble the deltas as a client would."""
    s = ToolCallStream(get_tool_parser(parser_name))
    content, calls = "", {}
    for i, end in enumerate([*cuts, len(text)]):
        delta = s.update(text[:end], final=i == len(cuts))
        content += delta.get("content", "")
        for tc in delta.get("tool_calls", []):
            if "id" in tc:
                assert tc["index"] not in calls and tc["type"] == "function" and tc["id"].startswith("call_")
                calls[tc["index"]] = {"name": tc["function"]["name"], "arguments": ""}
            else:
                assert set(tc["function"]) == {"arguments"}
            calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
    return content, calls


@pytest.mark.parametrize("parser_name,case", [("hermes", c) for c in HERMES_CASES] + [("llama3_json", c) for c in LLAMA_CASES])
def test_streamed_deltas_concatenate_to_the_parse(parser_name, case):
    text = case[0]
    whole = get_tool_parser(parser_name).parse(text)
    expected_calls = {i: {"name": c.name, "arguments": c.arguments} for i, c in enumerate(whole.tool_calls)}
    rng = random.Random(0)
    splits = [list(range(1, len(text))),  # one character at a time
              sorted(rng.sample(range(1, len(text)), min(5, len(text) - 1))), []]
    for cuts in splits:
        content, calls = stream(parser_name, text, cuts)
        assert content == (whole.content or "")
        if text in ANNOUNCED_THEN_MALFORMED:
            assert not expected_calls and [c["name"] for c in calls.values()] in ([], ["bad"], ["x"], ["f"])
            assert all("</tool_call" not in c["arguments"] for c in calls.values())
        else:
            assert calls == expected_calls


def test_stream_sends_no_markup_as_content_and_the_name_before_the_arguments():
    text = ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>')
    s = ToolCallStream(get_tool_parser("hermes"))
    events = []
    for end in range(1, len(text) + 1):
        delta = s.update(text[:end], final=end == len(text))
        if "content" in delta:
            assert "<" not in delta["content"] and "{" not in delta["content"]
            events.append(("content", delta["content"]))
        for tc in delta.get("tool_calls", []):
            events.append(("name", tc["function"]["name"]) if "id" in tc else ("args", tc["function"]["arguments"]))
    first_call = events.index(("name", "get_weather"))
    assert all(kind == "content" for kind, _ in events[:first_call])
    assert "".join(text for _, text in events[:first_call]) == "Sure."
    args = [e[1] for e in events[first_call + 1:]]
    assert len(args) > 5  # streamed as written, not in one piece at the end
    assert all(kind == "args" for kind, _ in events[first_call + 1:])
    assert json.loads("".join(args)) == {"city": "Paris", "days": 3}


def test_stream_drops_calls_past_max_calls():
    text = HERMES_CASES[1][0]  # two calls
    s = ToolCallStream(get_tool_parser("hermes"), max_calls=1)
    indexes = {tc["index"] for end in range(1, len(text) + 1)
               for tc in s.update(text[:end], final=end == len(text)).get("tool_calls", [])}
    assert indexes == {0} and s.num_calls == 1


def test_content_around_a_partial_tag_is_held_back_until_it_is_known():
    s = ToolCallStream(get_tool_parser("hermes"))
    assert s.update("Hi <tool", final=False) == {"content": "Hi"}
    assert s.update("Hi <tooltip> x", final=False) == {"content": " <tooltip> x"}


def test_parser_for_template():
    assert parser_for_template("{% for t in tools %}<tool_call>{% endfor %}").name == "hermes"
    assert parser_for_template("<|start_header_id|>ipython<|end_header_id|>").name == "llama3_json"
    assert parser_for_template({"default": "x", "tool_use": "<|python_tag|>"}).name == "llama3_json"
    assert parser_for_template("{{ messages }}") is None
    assert parser_for_template(None) is None
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        get_tool_parser("nope")
