"""Structured output and tool calling end to end: the official ``openai`` client against a
live server whose tiny random model has a Hermes-style (Qwen2.5) chat template. The model's
text is noise, so every assertion rests on what the grammar guarantees: ``parse`` returns a
valid object, "required" and named tools always produce a valid call, and an "auto" output
forced by a regex is parsed into calls, streamed and not. Schemas are bounded (enums,
maxLength) so that every output terminates."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "weather in Paris?"}]
MAX_TOKENS = 200  # a single call takes 60-120 tokens of this model (it likes whitespace)
JSON_MAX_TOKENS = 400  # the engine's JSON grammar lets whitespace run: 140-600 tokens here
PARALLEL_MAX_TOKENS = 500  # the model chooses how many calls; most seeds end within this


class Answer(BaseModel):
    verdict: Literal["yes", "no", "maybe"]
    score: int = Field(ge=0, le=9)
    note: str = Field(max_length=5)  # a length-bounded string: no raw control characters may get in


@pytest.fixture(scope="module")
def tool_server(tiny_model, hermes_template, server_process, tmp_path_factory):
    from transformers import AutoTokenizer

    model = tmp_path_factory.mktemp("hermes_model")
    for f in Path(tiny_model).iterdir():
        if f.is_file() and "token" not in f.name and "chat_template" not in f.name:
            (model / f.name).write_bytes(f.read_bytes())
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = hermes_template
    tok.save_pretrained(model)
    srv = server_process(model, ["--max-model-len", "1024", "--kv-cache-memory", "16000000"],
                        tmp_path_factory.mktemp("logs") / "tools.log")
    try:
        yield srv.wait_ready()
    finally:
        assert srv.terminate() == 0, srv.log_tail()


@pytest.fixture(scope="module")
def client(tool_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tool_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def check_call(name: str, arguments: str, allowed=("get_weather", "get_time")) -> dict:
    assert name in allowed
    args = json.loads(arguments)
    if name == "get_weather":
        assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f") and len(args["city"]) <= 6
    else:
        assert args in ({"zone": "utc"}, {"zone": "cet"})
    return args


def stream_chat(client, **kw) -> tuple[str, dict[int, dict], str]:
    """Content, tool calls by index (name, id, arguments joined) and the finish reason of a stream."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                if tc.index not in calls:  # the first delta of a call names it
                    assert tc.id.startswith("call_") and tc.type == "function" and tc.function.name
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                else:
                    assert tc.id is None and not tc.function.name
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return content, calls, finish


def test_parse_with_a_pydantic_response_format(client):
    """Seeds whose JSON outruns JSON_MAX_TOKENS (the grammar allows whitespace runs) are skipped."""
    parsed = []
    for seed in range(1, 9):
        try:
            out = client.chat.completions.parse(model="tiny", messages=ASK, response_format=Answer,
                                                max_tokens=JSON_MAX_TOKENS, temperature=1.0, seed=seed)
        except openai.LengthFinishReasonError:
            continue
        assert out.choices[0].finish_reason == "stop"
        assert isinstance(out.choices[0].message.parsed, Answer), out.choices[0].message.content
        parsed.append(out.choices[0].message.parsed)
        if len(parsed) == 2:
            return
    pytest.fail(f"only {len(parsed)} of 8 seeds ended within {JSON_MAX_TOKENS} tokens")


def test_guided_choice_on_completions(client):
    done = client.completions.create(model="tiny", prompt="Is it?", max_tokens=10, temperature=1.0, seed=4,
                                     extra_body={"guided_choice": ["yes", "no"]})
    assert done.choices[0].text in ("yes", "no")


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_round_trip(client, stream):
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
              max_tokens=MAX_TOKENS, temperature=1.0, seed=5)
    if stream:
        content, calls, finish = stream_chat(client, **kw)
        assert content == ""  # the grammar leaves no room for text
        calls = [(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())]
    else:
        msg = client.chat.completions.create(**kw).choices[0]
        finish, content = msg.finish_reason, msg.message.content
        assert content is None
        calls = [(c.id, c.function.name, c.function.arguments) for c in msg.message.tool_calls]
    assert finish == "tool_calls" and len(calls) == 1
    check_call(*calls[0][1:])
    # the results go back as tool messages; the model answers (tool_choice none: no calls)
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in calls]}]
    history += [{"role": "tool", "tool_call_id": i, "content": '{"temp": 21}'} for i, _, _ in calls]
    final = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none",
                                           max_tokens=8, temperature=1.0, seed=6)
    assert final.choices[0].message.tool_calls is None
    assert final.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_calls_that_tool_once(client, stream):
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=1.0, seed=7,
              tool_choice={"type": "function", "function": {"name": "get_time"}})
    if stream:
        _, calls, finish = stream_chat(client, **kw)
        calls = [(c["name"], c["arguments"]) for c in calls.values()]
    else:
        choice = client.chat.completions.create(**kw).choices[0]
        finish = choice.finish_reason
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert finish == "tool_calls" and len(calls) == 1
    check_call(*calls[0], allowed=("get_time",))


def test_required_parallel_calls_stream_as_they_return(client):
    """Parallel calls: each valid, and a stream of the same seeded request gives the same calls.
    The model decides how many calls to make; seeds whose calls outrun the context are skipped."""
    checked = 0
    for seed in range(1, 7):
        kw = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=PARALLEL_MAX_TOKENS,
                  temperature=1.0, seed=seed)
        choice = client.chat.completions.create(**kw).choices[0]
        if choice.finish_reason == "length":
            continue
        assert choice.finish_reason == "tool_calls", choice.message.content
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        for call in calls:
            check_call(*call)
        content, streamed, finish = stream_chat(client, **kw)
        assert (content, finish) == ("", "tool_calls")
        assert [(c["name"], c["arguments"]) for _, c in sorted(streamed.items())] == calls
        assert len({c.id for c in choice.message.tool_calls}) == len(calls)
        checked += 1
        if checked == 2:
            return
    pytest.fail(f"only {checked} of 6 seeds ended within {PARALLEL_MAX_TOKENS} tokens")


def test_each_streamed_choice_carries_its_own_calls(client):
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, n=2,
              max_tokens=MAX_TOKENS, temperature=1.0, seed=12)
    calls: dict[int, list] = {0: [], 1: []}
    finish = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            assert not c.delta.content
            for tc in c.delta.tool_calls or []:
                if tc.id:
                    calls[c.index].append([tc.function.name, ""])
                calls[c.index][tc.index][1] += tc.function.arguments or ""
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    for index in (0, 1):
        assert len(calls[index]) == 1
        check_call(*calls[index][0])
    whole = client.chat.completions.create(**kw)
    assert {c.index: [[t.function.name, t.function.arguments] for t in c.message.tool_calls]
            for c in whole.choices} == calls


CALL_TEXT = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_the_models_own_call(client, stream):
    """tool_choice auto leaves the model free; a regex makes this one write a call, which the
    hermes parser must find (and keep out of the content)."""
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=1.0, seed=10,
              extra_body={"guided_regex": re.escape(CALL_TEXT)})
    if stream:
        content, calls, finish = stream_chat(client, **kw)
        calls = [(c["name"], c["arguments"]) for c in calls.values()]
    else:
        choice = client.chat.completions.create(**kw).choices[0]
        content, finish = choice.message.content, choice.finish_reason
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert content == "Sure."
    assert calls == [("get_weather", '{"city": "Paris", "unit": "c"}')]
    assert finish == "tool_calls"


def test_auto_without_parallel_calls_returns_the_first(client):
    two = CALL_TEXT + '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=MAX_TOKENS, extra_body={"guided_regex": re.escape(two)})
    assert len(client.chat.completions.create(**kw).choices[0].message.tool_calls) == 2
    for stream in (False, True):
        if stream:
            _, calls, _ = stream_chat(client, parallel_tool_calls=False, **kw)
            names = [c["name"] for c in calls.values()]
        else:
            names = [c.function.name for c in client.chat.completions.create(
                parallel_tool_calls=False, **kw).choices[0].message.tool_calls]
        assert names == ["get_weather"]


def test_auto_without_a_call_is_content(client):
    choice = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=MAX_TOKENS,
                                            extra_body={"guided_regex": "It is sunny\\."}).choices[0]
    assert choice.message.content == "It is sunny." and choice.message.tool_calls is None
    assert choice.finish_reason == "stop"


def post(srv, body: dict, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=60)


@pytest.mark.parametrize("extra,param", [
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_refusals_are_400s_before_a_stream_starts(tool_server, extra, param, stream):
    r = post(tool_server, {"messages": ASK, "max_tokens": 4, "stream": stream, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    completion = {k: v for k, v in extra.items() if k not in ("tools", "tool_choice")}
    if completion == extra:
        r = post(tool_server, {"prompt": "x", "max_tokens": 4, "stream": stream, **extra}, "/v1/completions")
        assert r.status_code == 400 and r.json()["error"]["param"] == param
