"""SIGTERM: the server stops accepting, lets in-flight requests finish, exits with status 0;
and a full queue answers 503 (policy "reject"). Runs its own server process."""
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
