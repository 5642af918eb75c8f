"""AsyncEngine's supervision, on a scripted engine: a step that raises fails only the request
it can be pinned on (the others finish every token), failures that cannot be pinned fail the
batch and, three in a row, end the thread and call ``on_death``; mailboxes and admission stay
bounded."""
from __future__ import annotations

import asyncio

import pytest

from specdec.outputs import CompletionOutput, RequestOutput
from specdec.sampling_params import SamplingParams
from specdec.server.admission import Admission, Closed, QueueFull
from specdec.server.async_engine import AsyncEngine, EngineRequest
from specdec.server.mailbox import Mailbox
from specdec.server.metrics import ServerMetrics

POISON = 7  # a prompt holding this token id makes every step it is in raise


class ScriptedEngine:
    """The EngineCore methods AsyncEngine calls; one token per request per step."""

    def __init__(self, fail_after: int | None = None, broken_after_steps: int | None = None):
        self.groups: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}
        self.fail_after = fail_after  # every step fails once a request has this many tokens
        self.broken_after_steps = broken_after_steps  # then every step fails, whoever is in it
        self.num_steps = 0

    def add_request(self, request_id, prompt_token_ids, params, prompt=None, lora_request=None):
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.groups[request_id] = (prompt_token_ids, params, [])

    def abort_request(self, request_ids):
        for rid in request_ids:
            self.groups.pop(rid, None)

    def has_unfinished_requests(self):
        return bool(self.groups)

    def get_metrics(self):
        return {"num_running": len(self.groups)}

    def step(self):
        self.num_steps += 1
        if self.broken_after_steps is not None and self.num_steps > self.broken_after_steps:
            raise RuntimeError("device lost")
        if any(POISON in ids for ids, _, _ in self.groups.values()):
            raise RuntimeError("Overflow when unpacking long")
        if self.fail_after is not None and any(len(out) >= self.fail_after for *_, out in self.groups.values()):
            raise RuntimeError("a bug late in a request's life")
        outputs = []
        for rid, (ids, params, out) in list(self.groups.items()):
            out.append(len(out))
            done = len(out) >= params.max_tokens
            outputs.append(RequestOutput(rid, None, ids, [CompletionOutput(0, "", list(out),
                                                                           finish_reason="length" if done else None)],
                                         done))
            if done:
                del self.groups[rid]
        return outputs


async def _collect(box: Mailbox, request_ids: set[str]) -> dict[str, int] | BaseException:
    """Tokens per request once all finish, or the error the mailbox raised."""
    num_tokens: dict[str, int] = {}
    unfinished = set(request_ids)
    try:
        while unfinished:
            for out in await box.take():
                num_tokens[out.request_id] = len(out.outputs[0].token_ids)
                if out.finished:
                    unfinished.discard(out.request_id)
    except Exception as e:  # noqa: BLE001
        return e
    return num_tokens


def _run(engine: ScriptedEngine, prompts: list[list[list[int]]], deaths: list | None = None):
    """Submit one HTTP request per entry of ``prompts`` (a list of prompts) at once."""
    metrics = ServerMetrics("m", lambda: {})

    async def main():
        ae = AsyncEngine(engine, metrics, on_death=lambda: deaths.append(1) if deaths is not None else None)
        ae.start()
        boxes = []
        for i, group in enumerate(prompts):
            reqs = [EngineRequest(f"r{i}-{j}", ids, SamplingParams(max_tokens=5)) for j, ids in enumerate(group)]
            box = Mailbox()
            ae.submit(reqs, box)
            boxes.append(_collect(box, {r.request_id for r in reqs}))
        results = await asyncio.wait_for(asyncio.gather(*boxes), 30)
        alive = ae.is_alive
        ae.stop(5)
        return results, alive

    results, alive = asyncio.run(main())
    counts = {k: v for k, v in _samples(metrics).items()}
    return results, alive, counts


def _samples(metrics: ServerMetrics) -> dict[str, float]:
    out = {}
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name.endswith("_total"):
                out[s.name.removeprefix("specdec:") + str(s.labels.get("finished_reason", ""))] = s.value
    return out


def test_a_poisoned_request_fails_alone_and_the_others_finish_every_token():
    engine = ScriptedEngine()
    prompts = [[[1, 2]], [[3]], [[4], [POISON]], [[5]], [[6]]]  # request 2: two prompts, one poisoned
    results, alive, counts = _run(engine, prompts)
    assert alive
    assert isinstance(results[2], RuntimeError) and "made the engine step fail" in str(results[2])
    for i in (0, 1, 3, 4):
        assert results[i] == {f"r{i}-0": 5}, i
    assert counts["request_failed_total"] == 2  # both prompts of the offending request
    assert counts["request_success_totallength"] == 4
    assert not engine.groups


def test_failures_that_cannot_be_pinned_fail_the_batch_and_a_broken_engine_ends_the_thread():
    deaths: list = []
    engine = ScriptedEngine(fail_after=2)  # every request fails at its third step, not its first
    results, alive, counts = _run(engine, [[[1]], [[2]]], deaths)
    assert all(isinstance(r, RuntimeError) and "engine step failed" in str(r) for r in results)
    assert alive and not deaths  # one unattributed failure: the thread goes on
    assert counts["request_failed_total"] == 2

    async def three_batches() -> list[bool]:
        ae = AsyncEngine(ScriptedEngine(broken_after_steps=2), on_death=lambda: deaths.append(1))
        ae.start()
        alive = []
        for i in range(3):
            box = Mailbox()
            ae.submit([EngineRequest(f"x{i}", [1], SamplingParams(max_tokens=5))], box)
            assert isinstance(await asyncio.wait_for(_collect(box, {f"x{i}"}), 10), Exception)
            await asyncio.sleep(0.1)
            alive.append(ae.is_alive)
        return alive

    # after 2 good steps every step fails: each request fails (alone, but with no good step to
    # compare with) and the third such failure in a row ends the thread
    assert asyncio.run(three_batches()) == [True, True, False]
    assert deaths == [1]


def test_mailbox_keeps_only_the_latest_output_per_prompt():
    async def main():
        box = Mailbox()
        for n in range(1000):  # a client that never reads
            box.put(RequestOutput("a", None, [1], [CompletionOutput(0, "", list(range(n)))], False))
            box.put(RequestOutput("b", None, [1], [CompletionOutput(0, "", list(range(n)))], False))
        assert box.num_held == 2
        items = await box.take()
        assert sorted((o.request_id, len(o.outputs[0].token_ids)) for o in items) == [("a", 999), ("b", 999)]
        box.put(RuntimeError("first"))
        box.put(RuntimeError("second"))
        with pytest.raises(RuntimeError, match="first"):
            await box.take()

    asyncio.run(main())


def test_admission_bounds_its_waiters_and_closes():
    async def main():
        adm = Admission(capacity=1, policy="wait", max_waiting=2)
        await adm.acquire(1)
        waiters = [asyncio.ensure_future(adm.acquire(1)) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(QueueFull, match="--max-waiting 2"):
            await adm.acquire(1)
        adm.close("shutting down")
        results = await asyncio.gather(*waiters, return_exceptions=True)
        assert all(isinstance(r, Closed) for r in results)
        assert adm.num_in_use == 1 and adm.num_waiting == 0  # closing hands out nothing
        with pytest.raises(Closed):
            await adm.acquire(1)

    asyncio.run(main())
