"""Reasoning output: the parsers split thinking from the answer (whole, and streamed in any
split), and end to end, through the official ``openai`` client against the in-process app on a
tiny Qwen3 whose template thinks (tests/conftest.py ``thinking_model_path``), with speculative
decoding on (a draft-model tree): ``reasoning_content`` holds the thinking, ``content`` the
answer, and a ``response_format`` schema or a tool-call grammar constrains the answer only."""
from __future__ import annotations

import json
import random

import openai
import pytest
from transformers import AutoTokenizer

from specdec import LLM
from specdec.server.app import ServerSettings, build_app
from specdec.server.reasoning import CLOSED, OPEN, OPTIONAL, ReasoningStream, get_reasoning_parser

SPLITS = [  # parser, mode, output, reasoning, content
    ("deepseek_r1", OPEN, "Let me think.\nOK.</think>\n\nThe answer is 4.", "Let me think.\nOK.", "The answer is 4."),
    ("deepseek_r1", OPEN, "<think>\nhm</think>4", "hm", "4"),  # an older R1 template: the model opens it
    ("deepseek_r1", OPEN, "still thinking", "still thinking", ""),  # cut before the end: all reasoning
    ("qwen3", OPTIONAL, "<think>\nThe user asks.\n</think>\n\n{\"a\": 1}", "The user asks.\n", '{"a": 1}'),
    ("qwen3", OPTIONAL, "Paris.", None, "Paris."),  # no thinking
    ("qwen3", CLOSED, "<think>x</think>y", None, "<think>x</think>y"),  # the prompt closed it
    ("gpt_oss", OPEN, "<|channel|>analysis<|message|>User asks weather.<|end|><|start|>assistant<|channel|>final"
                      "<|message|>Sunny.", "User asks weather.", "Sunny."),
    ("gpt_oss", OPEN, "<|channel|>final<|message|>Hi.", "", "Hi."),
]


@pytest.fixture(scope="module")
def tokenizer(thinking_model_path):
    return AutoTokenizer.from_pretrained(thinking_model_path)


@pytest.mark.parametrize("name,mode,text,reasoning,content", SPLITS)
def test_split_whole_and_streamed(tokenizer, name, mode, text, reasoning, content):
    parser = get_reasoning_parser(name, tokenizer)
    assert parser.split(text, mode, final=True) == (reasoning, content)
    rng = random.Random(0)
    for cuts in (list(range(1, len(text))), sorted(rng.sample(range(1, len(text)), 4))):
        stream = ReasoningStream(parser, mode)
        sent_reasoning = sent_content = ""
        for i, end in enumerate([*cuts, len(text)]):
            new_reasoning, new_content, _ = stream.update(text[:end], final=i == len(cuts))
            sent_reasoning += new_reasoning
            sent_content += new_content
            assert "<think>" not in sent_reasoning + sent_content or mode == CLOSED
        assert (sent_reasoning, sent_content) == (reasoning or "", content)


def test_where_the_output_starts_is_read_from_the_prompt(tokenizer):
    parser = get_reasoning_parser("qwen3", tokenizer)

    def prompt(**kw):
        return tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                             tokenize=False, **kw)

    assert parser.mode(tokenizer.encode(prompt())) == OPEN  # the template opened it
    assert parser.mode(tokenizer.encode(prompt(enable_thinking=False))) == CLOSED
    assert parser.mode(tokenizer.encode("<|bos|>user: hi\n<|bos|>assistant: ")) == OPTIONAL
    assert get_reasoning_parser("deepseek_r1", tokenizer).mode(tokenizer.encode("assistant: ")) == OPEN
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        get_reasoning_parser("nope", tokenizer)


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}}, "required": ["n", "ok"]}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
ASK = [{"role": "user", "content": "def f(x):"}]


@pytest.fixture(scope="module")
def client(thinking_model_path, make_perturbed_copy, tmp_path_factory):
    from starlette.testclient import TestClient

    draft = make_perturbed_copy(thinking_model_path, tmp_path_factory.mktemp("thinking_draft"), scale=0.1, seed=3)
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3, "tree_topk": 2, "tree_nodes": 6}
    llm = LLM(model=thinking_model_path, dtype="float32", device="cpu", max_model_len=512, num_threads=1,
              speculative_config=spec)
    settings = ServerSettings(model_name="tiny", reasoning_parser="deepseek_r1")
    with TestClient(build_app(llm.engine, settings)) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def stream_parts(client, **kw) -> tuple[str, str, str | None]:
    reasoning, content, finish = "", "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
            finish = c.finish_reason or finish
    return reasoning, content, finish


def test_thinking_and_a_json_answer_apart_with_speculation(client):
    kw = dict(model="tiny", messages=ASK, response_format=FORMAT, max_tokens=200, temperature=0)
    response = client.chat.completions.create(**kw)
    assert response.usage.model_extra["spec_decode"]["num_accepted_tokens"] > 0  # the drafts ran
    choice = response.choices[0]
    message = choice.message
    assert message.reasoning_content and "think>" not in message.reasoning_content
    assert set(json.loads(message.content)) == {"n", "ok"} and choice.finish_reason == "stop"
    plain = client.chat.completions.create(**kw, extra_body={"use_speculation": False}).choices[0].message
    assert (plain.reasoning_content, plain.content) == (message.reasoning_content, message.content)
    assert stream_parts(client, **kw) == (message.reasoning_content, message.content, "stop")
    hidden = client.chat.completions.create(**kw, extra_body={"include_reasoning": False}).choices[0].message
    assert hidden.content == message.content and getattr(hidden, "reasoning_content", None) is None


@pytest.mark.parametrize("extra", [{"enable_thinking": False}, {"chat_template_kwargs": {"enable_thinking": False}}])
def test_thinking_off_passes_to_the_template(client, extra):
    kw = dict(model="tiny", messages=ASK, response_format=FORMAT, max_tokens=200, temperature=0, extra_body=extra)
    message = client.chat.completions.create(**kw).choices[0].message
    assert message.reasoning_content is None
    assert set(json.loads(message.content)) == {"n", "ok"}  # the grammar from the first token


def test_a_required_tool_call_follows_the_thinking(client):
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}}}]
    kw = dict(model="tiny", messages=ASK, tools=tools, tool_choice="required", max_tokens=300, temperature=0)
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.message.reasoning_content and choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "lookup" and json.loads(call.function.arguments)["n"] in range(10)


@pytest.mark.parametrize("extra,param", [
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs.add_generation_prompt"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"enable_thinking": "no"}, "enable_thinking"),
    ({"enable_thinking": True, "chat_template_kwargs": {"enable_thinking": False}}, "enable_thinking"),
    ({"include_reasoning": 1}, "include_reasoning"),
])
def test_bad_reasoning_fields_are_400s_naming_them(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=2, extra_body=extra)
    assert e.value.body["param"] == param
