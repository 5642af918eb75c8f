"""Each tool-call format round-trips through the official ``openai`` client against the
in-process app (one engine, an app per ``--tool-call-parser``): a regex makes the tiny random
model write one documented call in that format under tool_choice "auto", and the client gets
it back as ``tool_calls``, streamed and not, with the text around it as content."""
from __future__ import annotations

import json
import re

import openai
import pytest

from specdec import LLM
from specdec.server.app import ServerSettings, build_app

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
ASK = [{"role": "user", "content": "weather in Paris?"}]
EXPECTED = ("get_weather", {"city": "Paris", "days": 3})
OUTPUTS = {  # the model's own format, as its documentation writes a call
    "hermes": 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
    "mistral": 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
    "qwen3_coder": "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                   "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    "deepseek_v3": "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                   '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "pythonic": '[get_weather(city="Paris", days=3)]',
}


@pytest.fixture(scope="module")
def engine(tiny_model):
    return LLM(model=str(tiny_model), dtype="float32", device="cpu", max_model_len=512, num_threads=1).engine


def client_for(engine, parser: str | None):
    from starlette.testclient import TestClient

    http = TestClient(build_app(engine, ServerSettings(model_name="tiny", tool_call_parser=parser)))
    return http, openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def stream_chat(client, **kw):
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                if tc.id:
                    calls[tc.index] = [tc.function.name, ""]
                calls[tc.index][1] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return content or None, [tuple(v) for _, v in sorted(calls.items())], finish


@pytest.mark.parametrize("parser", sorted(OUTPUTS))
def test_auto_round_trips_each_format(engine, parser):
    text = OUTPUTS[parser]
    http, client = client_for(engine, parser)
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=400, extra_body={"guided_regex": re.escape(text)})
    with http:
        choice = client.chat.completions.create(**kw).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        streamed = stream_chat(client, **kw)
    expected_content = "Sure." if text.startswith("Sure.") else None
    assert choice.message.content == expected_content and choice.finish_reason == "tool_calls"
    assert [(n, json.loads(a)) for n, a in calls] == [EXPECTED]
    assert streamed == (expected_content, calls, "tool_calls")


def test_required_and_named_work_without_a_format(engine):
    """The tiny template shows no tool format: "auto" is refused (naming the way out), while
    "required" and a named tool are constrained to the JSON form and parsed."""
    http, client = client_for(engine, None)
    base = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=300, temperature=1.0, seed=3)
    with http:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**base)
        assert e.value.body["param"] == "tool_choice" and "required" in e.value.body["message"]
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            whole = client.chat.completions.create(tool_choice=choice, parallel_tool_calls=False, **base).choices[0]
            assert whole.finish_reason == "tool_calls" and whole.message.content is None
            (call,) = whole.message.tool_calls
            assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments), dict)
            assert stream_chat(client, tool_choice=choice, parallel_tool_calls=False, **base) == (
                None, [(call.function.name, call.function.arguments)], "tool_calls")
