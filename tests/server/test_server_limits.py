"""Limits, on servers of their own: a full queue answers 503 (policy "reject") or holds
requests in order (policy "wait"); SIGTERM stops accepting, lets in-flight requests finish
and exits with status 0."""
from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import pytest


def test_sigterm_drains_in_flight_streams_and_exits_cleanly(make_server):
    srv = make_server(["--max-num-seqs", "2", "--max-queue", "0"])
    events: list[str] = []
    first_chunk = threading.Event()

    def stream():
        body = {"prompt": "def f(x):", "max_tokens": 120, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line)
                    first_chunk.set()

    async def over_capacity() -> list[int]:
        body = {"prompt": "x", "max_tokens": 60, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
            rs = await asyncio.gather(*[client.post("/v1/completions", json=body) for _ in range(4)])
        return [r.status_code for r in rs]

    codes = asyncio.run(over_capacity())  # capacity 2 (+ 0 queue): the rest are turned away
    assert sorted(codes) == [200, 200, 503, 503]

    t = threading.Thread(target=stream)
    t.start()
    assert first_chunk.wait(30)
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises(httpx.HTTPError):  # no longer accepting
        httpx.get(srv.url + "/health", timeout=2)
    t.join(60)
    assert srv.proc.wait(30) == 0
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # finished, not cut off


def test_wait_policy_serves_everyone_in_turn_and_drops_departed_waiters(make_server):
    srv = make_server(["--max-num-seqs", "1", "--max-queue", "0", "--queue-full-policy", "wait",
                       "--max-model-len", "1024"])
    body = {"prompt": "x", "max_tokens": 30, "ignore_eos": True, "temperature": 0}

    def admission() -> tuple[float, float]:
        m = srv.metrics()
        return m["specdec:admission_in_use"], m["specdec:admission_waiting"]

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
            long = {**body, "max_tokens": 1000, "stream": True}
            async with client.stream("POST", "/v1/completions", json=long) as first:
                lines = first.aiter_lines()  # kept referenced: a dropped iterator would close the stream
                await lines.__anext__()  # the first chunk: it holds the only slot now
                async with httpx.AsyncClient(base_url=srv.url, timeout=0.3) as impatient:
                    with pytest.raises(httpx.TimeoutException):  # waits for the slot, then gives up
                        await impatient.post("/v1/completions", json=body)
                await asyncio.sleep(0.1)
                during = admission()
                await lines.aclose()
            # the first stream is closed (aborted): three more are served one at a time
            return during, await asyncio.gather(*[client.post("/v1/completions", json=body) for _ in range(3)])

    during, responses = asyncio.run(main())
    assert during == (1, 0)  # the first holds its slot; the waiter left the queue
    assert [r.status_code for r in responses] == [200] * 3
    assert len({r.json()["choices"][0]["text"] for r in responses}) == 1  # the same greedy request
    m = srv.wait_idle()
    assert m["specdec:kv_cache_free_blocks"] == m["specdec:kv_cache_total_blocks"]
    assert admission() == (0, 0)
    assert m['specdec:request_success_total{finished_reason="length"}'] == 3
    assert m["specdec:request_aborted_total"] == 1  # the first; the impatient one never reached the engine


def test_sigterm_past_the_timeout_ends_streams_in_band_and_a_second_sigterm_still_exits_0(make_server):
    srv = make_server(["--shutdown-timeout", "1", "--max-model-len", "1024"])
    # long enough to outlast the 1 s timeout on a fast CPU
    long = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "n": 16}
    events: list[str] = []
    plain: list[httpx.Response] = []
    streaming = threading.Event()

    def stream():
        with httpx.stream("POST", srv.url + "/v1/completions", json={**long, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line)
                    streaming.set()

    threads = [threading.Thread(target=stream),
               threading.Thread(target=lambda: plain.append(httpx.post(srv.url + "/v1/completions", json=long,
                                                                         timeout=60)))]
    for t in threads:
        t.start()
    assert streaming.wait(30)
    time.sleep(0.3)
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    while srv.proc.poll() is None and time.monotonic() - t0 < 30:  # more signals, through drain and teardown
        time.sleep(0.2)
        srv.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(30)
    assert srv.proc.wait(30) == 0
    assert time.monotonic() - t0 < 15
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][6:])["error"]
    assert "--shutdown-timeout" in error["message"] and error["code"] == "engine_unavailable"
    assert plain[0].status_code == 503 and "--shutdown-timeout" in plain[0].json()["error"]["message"]
