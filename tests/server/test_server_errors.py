"""Raw HTTP error cases: each answers OpenAI's error shape with the right status and names
the offending field, and none of them disturbs a request running alongside."""
from __future__ import annotations

import json
import threading

import httpx
import pytest


def post(server, path: str, body, headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json",
                                                                   **(headers or {})}, timeout=30)


def assert_error(r: httpx.Response, status: int, param: str | None = None, *fragments: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    for fragment in fragments:
        assert fragment in err["message"], err
    return err


def test_malformed_json(server):
    assert_error(post(server, "/v1/completions", b'{"prompt": "x",'), 400, None, "malformed JSON")
    assert_error(post(server, "/v1/chat/completions", b"not json"), 400, None, "malformed JSON")
    assert_error(post(server, "/v1/completions", b'["a list"]'), 400, None, "JSON object")


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "n": 1.5}, "n"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": 123}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
])
def test_wrong_types_name_the_field(server, body, param):
    assert_error(post(server, "/v1/completions", body), 400, param)


@pytest.mark.parametrize("body, param", [
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages.0.role"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 1.5}, "top_p"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
])
def test_chat_bad_fields(server, body, param):
    assert_error(post(server, "/v1/chat/completions", body), 400, param)


def test_out_of_range_values(server):
    assert_error(post(server, "/v1/completions", {"prompt": "x", "max_tokens": -5}), 400, "max_tokens", "-5")
    assert_error(post(server, "/v1/completions", {"prompt": "x", "top_p": 0}), 400, "top_p")
    assert_error(post(server, "/v1/completions", {"prompt": "x", "n": 0}), 400, "n")
    assert_error(post(server, "/v1/completions", {"prompt": "x", "presence_penalty": 3}), 400, "presence_penalty")
    assert_error(post(server, "/v1/completions", {"prompt": [1, 2, 10**6]}), 400, "prompt", "vocabulary")


def test_prompt_longer_than_context_names_both_numbers(server):
    MAX_MODEL_LEN = server.max_model_len
    ids = [5] * (MAX_MODEL_LEN + 44)
    err = assert_error(post(server, "/v1/completions", {"prompt": ids, "max_tokens": 1}), 400, "prompt")
    assert str(MAX_MODEL_LEN + 44) in err["message"] and str(MAX_MODEL_LEN) in err["message"]
    long_text = "def f(x): return x\n" * 200
    assert_error(post(server, "/v1/completions", {"prompt": long_text}), 400, "prompt", str(MAX_MODEL_LEN))
    chat = {"messages": [{"role": "user", "content": long_text}]}
    assert_error(post(server, "/v1/chat/completions", chat), 400, "messages", str(MAX_MODEL_LEN))


def test_unknown_model_is_404(server):
    err = assert_error(post(server, "/v1/completions", {"prompt": "x", "model": "gpt-17"}), 404, "model", "gpt-17")
    assert err["code"] == "model_not_found"
    chat = {"model": "nope", "messages": [{"role": "user", "content": "x"}]}
    assert_error(post(server, "/v1/chat/completions", chat), 404, "model")


def test_api_key(spec_server):
    API_KEY = spec_server.api_key
    body = {"prompt": "x", "max_tokens": 2}
    assert_error(post(spec_server, "/v1/completions", body), 401, None, "API key")
    assert_error(post(spec_server, "/v1/completions", body, {"Authorization": "Bearer wrong"}), 401)
    assert_error(post(spec_server, "/v1/completions", body, {"Authorization": API_KEY}), 401)  # no scheme
    r = httpx.get(spec_server.url + "/v1/models")
    assert r.status_code == 401
    ok = post(spec_server, "/v1/completions", body, {"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200, ok.text
    assert httpx.get(spec_server.url + "/health").status_code == 200  # probes need no key
    assert httpx.get(spec_server.url + "/metrics").status_code == 200


def test_bad_requests_do_not_disturb_a_running_stream(server):
    body = {"prompt": "while True:", "max_tokens": 40, "temperature": 0.7, "seed": 99, "ignore_eos": True}
    expected = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    events: list[str] = []

    def stream():
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            events.extend(line for line in r.iter_lines() if line)

    t = threading.Thread(target=stream)
    t.start()
    bad = [b"{", {"prompt": "x", "max_tokens": -1}, {"prompt": [10**7]}, {"prompt": [1] * 1000},
           {"prompt": "x", "model": "other"}, {"prompt": "x", "top_k": -3}]
    for i in range(3):
        for b in bad:
            assert post(server, "/v1/completions", b).status_code in (400, 404)
    t.join(60)
    assert events[-1] == "data: [DONE]"
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
    assert text == expected


def _run_asgi(app) -> list[dict]:
    import asyncio

    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app({"type": "http", "path": "/x", "method": "GET", "headers": []}, receive, send))
    return sent


def test_an_unexpected_error_is_one_500_and_the_connection_is_kept():
    """InternalErrors answers and returns normally (a re-raise would make uvicorn drop the
    connection without Connection: close); once a response started it must re-raise."""
    from specdec.server.error_middleware import InternalErrors

    async def broken(scope, receive, send):
        raise RuntimeError("boom")

    counted: list[int] = []
    sent = _run_asgi(InternalErrors(broken, on_error=counted.append))  # no exception escapes
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 500
    assert json.loads(sent[1]["body"]) == {"error": {"message": "internal server error: RuntimeError",
                                                     "type": "internal_server_error", "param": None, "code": None}}
    assert counted == [500]

    async def half_sent(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        _run_asgi(InternalErrors(half_sent))
