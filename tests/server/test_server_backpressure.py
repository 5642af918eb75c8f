"""Back-pressure and exposure on one server of their own (capacity 4, policy "wait" with one
waiter allowed, a 0.25 s write timeout (a fast machine generates the 4 x 1,000 tokens within a second
of the stall), a metrics key and an allowed-hosts list): a client that
stops reading is aborted and frees its KV blocks and its slots; waiters are bounded and a
stream's admission error is its status; keys and Host checks guard what they should."""
from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
from conftest import ServerProcess

METRICS_KEY = "metrics-key-9"


@pytest.fixture(scope="module")
def srv(tiny_model, tmp_path_factory):
    s = ServerProcess(tiny_model, ["--max-num-seqs", "4", "--max-queue", "0", "--queue-full-policy", "wait",
                                   "--max-waiting", "1", "--write-timeout", "0.25", "--metrics-api-key", METRICS_KEY,
                                   "--allowed-hosts", "localhost,127.0.0.1", "--enable-docs", "--max-model-len", "1024"],
                      tmp_path_factory.mktemp("bp") / "server.log")
    s.metrics_headers = {"Authorization": f"Bearer {METRICS_KEY}"}
    try:
        yield s.wait_ready()
    finally:
        assert s.terminate() == 0, s.log_tail()


def wait_for(srv, cond, timeout: float = 15.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = srv.metrics()
        if cond(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def test_a_client_that_stops_reading_is_aborted_and_frees_its_blocks(srv):
    before = srv.metrics()
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000, "ignore_eos": True,
                       "logprobs": True, "top_logprobs": 20, "n": 4, "stream": True, "return_token_ids": True})
    s = socket.socket()
    # ~7 MB of events (4 x 1000 tokens with 20 logprobs each) through a small window: the server's
    # socket buffers (at most 4 MB here) fill long before the generation ends
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", srv.port))
    try:
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        m = wait_for(srv, lambda m: m["specdec:request_aborted_total"] > before["specdec:request_aborted_total"])
        # the socket is still open and unread, yet the engine has let go of the request
        assert m["specdec:request_aborted_total"] == before["specdec:request_aborted_total"] + 1
        m = wait_for(srv, lambda m: m["specdec:kv_cache_free_blocks"] == m["specdec:kv_cache_total_blocks"])
        assert m["specdec:kv_cache_free_blocks"] == m["specdec:kv_cache_total_blocks"]
        assert m["specdec:admission_in_use"] == 0 and m["specdec:num_requests_in_flight"] == 0
        ok = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert ok.status_code == 200  # the stalled client holds nothing others need
    finally:
        s.close()


def test_waiters_are_bounded_and_a_full_queue_is_a_stream_status(srv):
    long = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "n": 4}

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
            holder = asyncio.create_task(client.post("/v1/completions", json=long))  # takes all 4 slots
            # each next request once the server shows the state it needs, while the holder still runs
            await asyncio.to_thread(wait_for, srv, lambda m: m["specdec:admission_in_use"] == 4)
            waiter = asyncio.create_task(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}))
            await asyncio.to_thread(wait_for, srv, lambda m: m["specdec:admission_waiting"] == 1)
            turned_away = await client.post("/v1/completions", json={**long, "stream": True, "n": 1})
            results = await asyncio.gather(holder, waiter)
            return turned_away, results

    turned_away, (holder, waiter) = asyncio.run(main())
    assert turned_away.status_code == 503, turned_away.text  # a status, before any event
    err = turned_away.json()["error"]
    assert err["code"] == "queue_full" and "--max-waiting 1" in err["message"]
    assert holder.status_code == 200 and waiter.status_code == 200


def test_metrics_key_allowed_hosts_and_docs_flag(srv):
    assert httpx.get(srv.url + "/metrics").status_code == 401
    assert httpx.get(srv.url + "/metrics", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert srv.metrics()["specdec:kv_cache_total_blocks"] > 0
    rebound = httpx.get(srv.url + "/health", headers={"Host": "evil.example:8000"})
    assert rebound.status_code == 400 and rebound.json()["error"]["code"] == "host_not_allowed"
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"Host": "attacker"})
    assert r.status_code == 400
    assert httpx.get(srv.url + "/health", headers={"Host": "localhost:1234"}).status_code == 200
    assert httpx.get(srv.url + "/openapi.json").status_code == 200  # --enable-docs
