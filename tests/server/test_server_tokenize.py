"""/tokenize and /detokenize on the shared server, as vLLM serves them: a prompt or chat
messages in, the token ids, their count and the context length out; ids back to text; every
bad input a 4xx in OpenAI's shape naming the field."""
from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer


def post(srv, path: str, body) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, headers=srv.headers, timeout=180)  # a first request waits for warm-up


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def test_tokenize_a_prompt_and_back(server, tokenizer):
    text = "def f(x):\n    return x"
    r = post(server, "/tokenize", {"model": "tiny", "prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == server.max_model_len and body["token_strs"] is None
    strs = post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()["token_strs"]
    assert strs == tokenizer.convert_ids_to_tokens(body["tokens"])
    assert post(server, "/detokenize", {"model": "tiny", "tokens": body["tokens"]}).json() == {"prompt": text}


def test_tokenize_messages_with_the_chat_template(server, tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    body = post(server, "/tokenize", {"messages": messages}).json()
    expected = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                                add_special_tokens=False)
    assert body["tokens"] == expected and body["count"] == len(expected)
    bare = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert bare["count"] < body["count"] and body["tokens"][:bare["count"]] == bare["tokens"]
    # the same count a chat completion reports as its prompt tokens
    done = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert done.status_code == 200, done.text
    assert done.json()["usage"]["prompt_tokens"] == body["count"]


@pytest.mark.parametrize("path,body,status,param", [
    ("/detokenize", {"tokens": [1, 2, 320]}, 400, "tokens.2"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {"tokens": [1.5]}, 400, "tokens.0"),
    ("/detokenize", {}, 400, "tokens"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": ["a"]}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
    ("/detokenize", {"tokens": [1], "model": "other"}, 404, "model"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
     400, "continue_final_message"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tools": []}},
     400, "chat_template_kwargs.tools"),
])
def test_bad_inputs_name_the_field(server, path, body, status, param):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] in ("invalid_request_error", "not_found_error")


def test_the_api_key_guards_them(spec_server):
    r = httpx.post(spec_server.url + "/tokenize", json={"prompt": "x"}, timeout=30)
    assert r.status_code == 401
    assert post(spec_server, "/tokenize", {"prompt": "x"}).status_code == 200
