"""Fuzzing the shared server: ~300 requests, a fixed corpus of hostile bodies, one of values at
the edges of what validation accepts (each must be served), plus 250 bodies hypothesis builds
from every field the endpoints know (values of every JSON type, huge and non-finite numbers,
lone surrogates, nesting; derandomized). Every answer must be a 2xx or a 4xx in OpenAI's
shape, never a 5xx, a hang or a dropped connection; afterwards /health is ok, a normal
request works and nothing runs or holds a KV block."""
from __future__ import annotations

import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.server.fuzz_corpus import CORPUS, CORPUS_OK

NUM_EXAMPLES = 250

_junk = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
                  st.text(max_size=20), st.just("\ud800"), st.lists(st.integers(-3, 300), max_size=4),
                  st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
_small_int = st.one_of(st.integers(-2, 6), st.sampled_from([0, 17, 21, 300, 2**31, 2**63, -(2**63) - 1]), _junk)
_unit = st.one_of(st.floats(-0.5, 2.5), st.sampled_from([0.0, 1.0, 1e-300, 1e308, 50.0]), _junk)
_text = st.one_of(st.text(max_size=30), st.sampled_from(["<|im_end|>", "\x00", "\U0001f600", "\udfff"]), _junk)
_stop = st.one_of(_text, st.lists(_text, max_size=20), st.just(["s"] * 17))
_common = {
    "model": st.one_of(st.just("tiny"), _text), "n": _small_int, "max_tokens": _small_int,
    "temperature": _unit, "top_p": _unit, "top_k": _small_int, "min_p": _unit, "seed": _small_int,
    "presence_penalty": _unit, "frequency_penalty": _unit, "repetition_penalty": _unit, "min_tokens": _small_int,
    "stop": _stop, "stop_token_ids": st.one_of(st.lists(_small_int, max_size=4), _junk),
    "stream": st.one_of(st.booleans(), _junk), "ignore_eos": st.booleans(), "logprobs": _small_int,
    "include_stop_str_in_output": st.booleans(), "return_token_ids": st.booleans(), "use_speculation": _junk,
    "stream_options": st.one_of(st.just({"include_usage": True}), _junk), "logit_bias": _junk, "user": _text,
    "skip_special_tokens": st.booleans(), "echo": st.booleans(), "best_of": _small_int, "suffix": _text,
    "response_format": st.one_of(st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "json_schema"},
                                                  {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
                                                  {"type": "json_schema", "json_schema": {"schema": {"type": 7}}}]),
                                 _junk),
    "structured_outputs": st.one_of(st.sampled_from([{"json_object": True}, {"regex": "a{0,99999}"}, {"choice": []},
                                                     {"grammar": 'root ::= "x" root'}, {"json": "{"}]), _junk),
    "guided_regex": st.one_of(st.sampled_from(["[ab]{1,3}", "(", "\\", "a*"]), _junk),
    "guided_choice": st.one_of(st.lists(_text, max_size=3), _junk), "guided_json": _junk, "guided_grammar": _text,
}
_tool = st.one_of(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "g", "bad name", ""])},
    optional={"parameters": st.one_of(st.just({"type": "object", "properties": {"a": {"type": "integer"}}}), _junk)})}),
    _junk)
_message = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "assistant"]), _text),
                                  "content": st.one_of(_text, st.lists(st.fixed_dictionaries(
                                      {"type": st.sampled_from(["text", "image"]), "text": _text}), max_size=2))})
_completion = st.fixed_dictionaries({"prompt": st.one_of(_text, st.lists(_text, max_size=3),
                                                         st.lists(_small_int, max_size=5), _junk)},
                                    optional=_common)
_chat = st.fixed_dictionaries({"messages": st.one_of(st.lists(_message, max_size=3), _junk)},
                              optional={**_common, "logprobs": st.one_of(st.booleans(), _junk),
                                        "top_logprobs": _small_int, "max_completion_tokens": _small_int,
                                        "functions": st.one_of(st.none(), st.lists(_junk, max_size=1)),
                                        "tools": st.one_of(st.lists(_tool, max_size=2), _junk),
                                        "tool_choice": st.one_of(st.sampled_from(
                                            ["auto", "none", "required", {"type": "function", "function": {"name": "f"}}]),
                                            _junk),
                                        "parallel_tool_calls": st.one_of(st.booleans(), _junk),
                                        "add_generation_prompt": st.one_of(st.booleans(), _junk)})
_request = st.one_of(st.tuples(st.just("/v1/completions"), _completion),
                     st.tuples(st.just("/v1/chat/completions"), _chat))


def check_answer(client: httpx.Client, path: str, raw: bytes) -> int:
    """Send one body; assert the answer is well-formed; return its status."""
    with client.stream("POST", path, content=raw, headers={"Content-Type": "application/json"}) as r:
        content = r.read()
    assert r.status_code < 500, (r.status_code, raw[:300], content[:300])
    if r.status_code >= 400:
        err = json.loads(content)["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and isinstance(err["type"], str)
        assert err["code"] is None or isinstance(err["code"], str), err
        return r.status_code
    assert r.status_code == 200
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in content.decode().split("\n") if line]
        assert events[-1] == "data: [DONE]", (raw[:300], events[-3:])
        for e in events[:-1]:
            chunk = json.loads(e[6:])
            assert "error" not in chunk, (raw[:300], chunk)
    else:
        assert json.loads(content)["choices"], raw[:300]
    return 200


def test_fuzzed_requests_never_5xx_and_leave_the_server_idle(server):
    statuses: list[int] = []  # of the hypothesis bodies
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for path, raw in CORPUS:
            check_answer(client, path, raw)  # a few are valid ("stop": [], a tool message)
        for path, body in CORPUS_OK:
            assert check_answer(client, path, json.dumps(body).encode()) == 200, body

        @settings(max_examples=NUM_EXAMPLES, derandomize=True, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(_request)
        def one(request):
            path, body = request
            if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
                body["max_tokens"] = 8  # keep the run short; huge values are exercised by the corpus
            statuses.append(check_answer(client, path, json.dumps(body, allow_nan=True).encode()))

        one()
        assert len(statuses) >= NUM_EXAMPLES
        assert statuses.count(200) >= 3 and statuses.count(400) >= NUM_EXAMPLES // 2  # both kinds were reached
        assert client.get("/health").json() == {"status": "ok"}
        ok = client.post("/v1/completions", json={"prompt": "def f(x):", "max_tokens": 4})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"]
    m = server.wait_idle()
    assert m["specdec:num_requests_running"] == 0 and m["specdec:num_requests_in_flight"] == 0
    assert m["specdec:kv_cache_free_blocks"] == m["specdec:kv_cache_total_blocks"]
    assert m["specdec:admission_in_use"] == 0
    assert m.get("specdec:request_failed_total", 0) == 0
