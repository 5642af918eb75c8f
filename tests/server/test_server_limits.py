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
    srv = make_server(["--max-num-seqs", "1", "--max-queue", "0", "--queue-full-policy", "wait"])
    body = {"prompt": "x", "max_tokens": 30, "ignore_eos": True, "temperature": 0}

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
            async def impatient():  # waits for a slot, gives up, and must leave the queue
                async with httpx.AsyncClient(base_url=srv.url, timeout=0.2) as c:
                    with pytest.raises(httpx.TimeoutException):
                        await c.post("/v1/completions", json={**body, "max_tokens": 200})

            first = asyncio.create_task(client.post("/v1/completions", json=body))
            await asyncio.sleep(0.05)
            rs = await asyncio.gather(first, impatient(), *[client.post("/v1/completions", json=body)
                                                            for _ in range(3)])
        return [r for r in rs if r is not None]

    responses = asyncio.run(main())
    assert [r.status_code for r in responses] == [200] * 4
    texts = {r.json()["choices"][0]["text"] for r in responses}
    assert len(texts) == 1  # same greedy request, one at a time
    m = srv.wait_idle()
    assert m["specdec:kv_cache_free_blocks"] == m["specdec:kv_cache_total_blocks"]
    assert httpx.get(srv.url + "/health").json()["admission_in_use"] == 0
    assert m["specdec:request_success_total{finished_reason=\"length\"}"] == 4  # the impatient one never ran
