"""Many clients at once share one continuous batch; departed clients leave nothing behind."""
from __future__ import annotations

import asyncio
import json

import httpx

PROMPTS = ["def f(x):", "import json", "class Decoder(object):", "    return value", "for i in range(10):",
           "x = [1, 2, 3]", "raise ValueError(msg)", "lines = text.splitlines()"]


def body(i: int, **kw) -> dict:
    return {"model": "tiny", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 16 + i % 9, "temperature": 0.8,
            "seed": 1000 + i, "ignore_eos": True, **kw}


async def read_stream(client: httpx.AsyncClient, payload: dict) -> tuple[str, str | None, int]:
    """Text, finish reason and completion tokens of one well-formed stream (asserted)."""
    text, finish, usage = "", None, None
    async with client.stream("POST", "/v1/completions", json=payload) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line async for line in r.aiter_lines()]
    events = [line for line in lines if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    for e in events[:-1]:
        chunk = json.loads(e[len("data: "):])
        assert "error" not in chunk, chunk
        if chunk.get("usage"):
            usage = chunk["usage"]
        for c in chunk["choices"]:
            assert finish is None, "no text after the finish reason"
            text += c["text"]
            finish = c["finish_reason"] or finish
    return text, finish, usage["completion_tokens"]


def test_32_concurrent_streams_match_non_streamed_and_free_every_block(server):
    num_clients = 32

    async def main():
        limits = httpx.Limits(max_connections=2 * num_clients)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            streams = [read_stream(client, body(i, stream=True, stream_options={"include_usage": True}))
                       for i in range(num_clients)]
            plain = [client.post("/v1/completions", json=body(i)) for i in range(num_clients)]
            return await asyncio.gather(asyncio.gather(*streams), asyncio.gather(*plain))

    streamed, plain = asyncio.run(main())
    for i, ((text, finish, num_tokens), response) in enumerate(zip(streamed, plain)):
        assert response.status_code == 200
        choice = response.json()["choices"][0]
        assert finish == "length"
        assert num_tokens == 16 + i % 9
        assert text == choice["text"], f"client {i}"
    m = server.wait_idle()
    assert m["specdec:kv_cache_free_blocks"] == m["specdec:kv_cache_total_blocks"] > 0
    assert m["specdec:num_requests_running"] == 0
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}  # no internals
    assert m["specdec:admission_in_use"] == 0


def test_clients_that_disconnect_are_aborted_and_free_their_blocks(server):
    before = server.metrics()
    long = {"max_tokens": 240, "ignore_eos": True, "temperature": 0.8}

    async def drop_stream(client: httpx.AsyncClient, i: int) -> int:
        seen = 0
        async with client.stream("POST", "/v1/completions", json=body(i, stream=True, **long)) as r:
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 3:
                    break  # leaving the block closes the connection mid-stream
        return seen

    async def hold_plain(client: httpx.AsyncClient, i: int) -> None:
        await client.post("/v1/completions", json=body(i, **long))  # cancelled long before it ends

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            plains = [asyncio.create_task(hold_plain(client, i)) for i in range(4)]
            # once every stream has seen 3 tokens the batch is busy and the engine really holds
            # blocks for all ten; dropping the plain requests then (not after a wall-clock timeout,
            # which a fast machine can outlive) closes their connections mid-generation
            results = await asyncio.gather(*(drop_stream(client, i) for i in range(6)))
            for task in plains:
                task.cancel()
            await asyncio.gather(*plains, return_exceptions=True)
        return results

    results = asyncio.run(main())
    assert results[:6] == [3] * 6
    m = server.wait_idle(timeout=10)
    assert m["specdec:num_requests_running"] == 0
    assert m["specdec:num_requests_waiting"] == 0
    assert m["specdec:num_requests_in_flight"] == 0
    assert m["specdec:kv_cache_free_blocks"] == m["specdec:kv_cache_total_blocks"]
    aborted = m["specdec:request_aborted_total"] - before["specdec:request_aborted_total"]
    assert aborted == 10  # none ran to its 240 tokens
    assert m["specdec:admission_in_use"] == 0
