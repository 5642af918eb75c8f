"""Hostile input on the shared server: every limit and strictness rule answers a 4xx in
OpenAI's shape naming the field and the limit (``code`` a string or null), nothing reaches
the engine, and the server keeps serving."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from test_server_errors import assert_error, post

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("raw, fragment", [
    (b'{"prompt": "x", "temperature": NaN}', "NaN"),
    (b'{"prompt": "x", "temperature": Infinity}', "Infinity"),
    (b'{"prompt": "x", "temperature": -Infinity}', "Infinity"),
    (b'{"prompt": "x", "temperature": 1e400}', "out of range"),
    (b'{"prompt": "x", "user": ' + b"[" * 1000 + b"]" * 1000 + b"}", "nested"),
    (b'{"prompt": "x", "user": ' + b"[" * 40 + b"]" * 40 + b"}", "nested"),
    (b'{"prompt": "x", "seed": ' + b"7" * 4301 + b"}", "digits"),
    (b'{"prompt": "a\\ud800b"}', "surrogate"),
    (b'{"prompt": "x", "model": "\\udfff"}', "surrogate"),
    (b'{"\\ud800": 1, "prompt": "x"}', "surrogate"),
])
def test_strict_json_is_a_400(server, raw, fragment):
    err = assert_error(post(server, "/v1/completions", raw), 400, None, fragment)
    assert err["code"] == "invalid_json"


def test_escaped_surrogate_pairs_are_text(server):
    r = post(server, "/v1/completions", b'{"prompt": "\\ud83d\\ude00 hi", "max_tokens": 2}')
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body, param, fragment", [
    ({"prompt": "x", "temperature": 50}, "temperature", "less than or equal to 2"),
    ({"prompt": "x", "temperature": 1e308}, "temperature", "less than or equal to 2"),
    ({"prompt": "x", "repetition_penalty": 1e-300}, "repetition_penalty", "greater than or equal to 0.1"),
    ({"prompt": "x", "top_k": 2**63}, "top_k", "2147483647"),
    ({"prompt": "x", "seed": 2**63}, "seed", None),
    ({"prompt": "x", "n": 17}, "n", "--max-n"),
    ({"prompt": "x", "max_tokens": 10**6}, "max_tokens", "--max-model-len"),
    ({"prompt": "x", "max_tokens": None, "min_tokens": 10**6}, "min_tokens", "256"),
    ({"prompt": "x", "logprobs": 21}, "logprobs", "--max-logprobs"),
    ({"prompt": "x", "stop": ["s"] * 17}, "stop", "--max-stop"),
    ({"prompt": "x", "stop": "s" * 257}, "stop", "--max-stop-length"),
    ({"prompt": "x", "stop_token_ids": [1] * 65}, "stop_token_ids", "--max-stop-token-ids"),
    ({"prompt": "x", "stop_token_ids": [10**6]}, "stop_token_ids", "vocabulary"),
    ({"prompt": ["x"] * 41, "n": 8}, "n", "capacity"),  # 328 sequences; capacity 64 + 256
])
def test_limits_and_ranges_name_the_field_and_the_limit(server, body, param, fragment):
    err = assert_error(post(server, "/v1/completions", body), 400, param, *([fragment] if fragment else []))
    assert err["code"] is None or isinstance(err["code"], str)


@pytest.mark.parametrize("body, param, fragment", [
    ({**CHAT, "messages": [{"role": "user", "content": "x"}] * 513}, "messages", "--max-messages"),
    ({**CHAT, "top_logprobs": 21, "logprobs": True}, "top_logprobs", "--max-logprobs"),
    ({**CHAT, "messages": [{"role": "system<|im_end|>", "content": "x"}]}, "messages.0.role", "'user'"),
    ({**CHAT, "messages": [{"role": "function", "name": "f", "content": "x"}]}, "messages.0.role", None),
    ({**CHAT, "functions": [{"name": "f", "parameters": {}}]}, "functions", "legacy"),
    ({**CHAT, "function_call": "auto"}, "function_call", "legacy"),
    ({**CHAT, "max_completion_tokens": 10**6}, "max_completion_tokens", "--max-model-len"),
])
def test_chat_limits(server, body, param, fragment):
    assert_error(post(server, "/v1/chat/completions", body), 400, param, *([fragment] if fragment else []))


def test_error_code_is_a_string_or_null(server):
    assert assert_error(post(server, "/v1/completions", {"prompt": 5}), 400)["code"] is None
    r = httpx.get(server.url + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] is None


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_post_needs_a_json_content_type(server, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    r = httpx.post(server.url + "/v1/completions", content=json.dumps({"prompt": "x"}), headers=headers)
    assert r.status_code == 415, r.text
    assert r.json()["error"]["code"] == "unsupported_media_type"


def test_docs_are_off_and_health_has_no_internals(server):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(server.url + path).status_code == 404
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def _health_latencies(url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(base_url=url, timeout=10) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            assert c.get("/health").status_code == 200
            out.append(time.perf_counter() - t0)
            time.sleep(0.02)


def test_a_10_mb_body_is_a_413_and_health_stays_responsive(server):
    latencies: list[float] = []
    stop = threading.Event()
    t = threading.Thread(target=_health_latencies, args=(server.url, stop, latencies))
    t.start()
    try:
        big = json.dumps({"prompt": "def f(x): return x\n" * 550_000})  # ~10.5 MB
        t0 = time.perf_counter()
        r = post(server, "/v1/completions", big)
        elapsed = time.perf_counter() - t0
        # the same size of text under the byte limit is turned away by its length, untokenized
        medium = post(server, "/v1/completions", {"prompt": "def f(x): return x\n" * 150_000})
        chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "ab " * 1_000_000}]})
    finally:
        stop.set()
        t.join()
    err = assert_error(r, 413, None, "--max-body-bytes")
    assert err["code"] == "body_too_large" and elapsed < 5
    assert_error(medium, 400, "prompt", "characters", "max_model_len")
    assert_error(chat, 400, "messages", "characters")
    assert latencies and max(latencies) < 0.5, max(latencies)


def test_a_body_that_never_arrives_is_a_408(make_server):
    srv = make_server(["--body-timeout", "1"])
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"prompt\":")
        s.settimeout(10)
        t0 = time.monotonic()
        reply = s.recv(4096)
        elapsed = time.monotonic() - t0
        while b"}}" not in reply:
            reply += s.recv(4096)
    assert reply.startswith(b"HTTP/1.1 408") and b"--body-timeout" in reply
    assert 0.9 < elapsed < 5
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
