"""The scheduler keeps each step within max_loras distinct adapters (first come, first served)
and the prefix cache never hands one adapter's blocks to another or to the base model."""
from __future__ import annotations

from specdec.engine.kv_cache_manager import KVCacheManager
from specdec.engine.output_processor import OutputProcessor
from specdec.engine.request import Request
from specdec.engine.scheduler import Scheduler
from specdec.lora.request import LoRARequest
from specdec.sampling_params import SamplingParams
from specdec.worker.model_runner_output import ModelRunnerOutput

ADAPTERS = [LoRARequest(f"a{i}", i, "/adapters") for i in (1, 2, 3)]


def _scheduler(max_loras: int) -> Scheduler:
    kv = KVCacheManager(64, 4)
    return Scheduler(kv, 8, 256, 64, stop_checker=OutputProcessor(None, 64), max_loras=max_loras)


def _request(rid: str, lora: LoRARequest | None, prompt=(1, 2, 3, 4, 5, 6, 7, 8, 9)) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=2, ignore_eos=True), lora_request=lora)


def _finish_step(sched: Scheduler, out) -> None:
    n = len(out.request_ids)
    sched.update_from_output(out, ModelRunnerOutput(
        request_ids=out.request_ids, sampled_token_ids=[[7]] * n, num_draft_tokens=[0] * n,
        num_accepted_tokens=[0] * n, logprobs=[None] * n))


def test_steps_hold_at_most_max_loras_adapters():
    sched = _scheduler(max_loras=2)
    loras = [ADAPTERS[0], None, ADAPTERS[1], ADAPTERS[2], ADAPTERS[0], None, ADAPTERS[2]]
    for i, lora in enumerate(loras):
        sched.add_request(_request(str(i), lora))
    seen_batches = []
    while sched.has_unfinished():
        out = sched.schedule()
        ids = {sched.requests[r].lora_request.lora_int_id for r in out.request_ids
               if sched.requests[r].lora_request is not None}
        assert len(ids) <= 2
        seen_batches.append(out.request_ids)
        _finish_step(sched, out)
    # the first step stops admitting at adapter 3 (first come, first served)
    assert seen_batches[0] == ["0", "1", "2"]
    assert {r for batch in seen_batches for r in batch} == {str(i) for i in range(len(loras))}


def test_new_request_data_carries_the_adapter():
    sched = _scheduler(max_loras=1)
    sched.add_request(_request("a", ADAPTERS[1]))
    out = sched.schedule()
    assert out.new_requests[0].lora_request == ADAPTERS[1]


def test_prefix_cache_entries_are_per_adapter():
    kv = KVCacheManager(32, 4)
    prompt = list(range(1, 14))

    def run(rid, lora):
        req = _request(rid, lora, prompt)
        blocks, hit = kv.get_computed_blocks(req)
        kv.allocate_slots(req, len(prompt) - hit, blocks)
        req.num_computed_tokens = len(prompt)
        kv.cache_full_blocks(req)
        kv.free(req)
        return hit

    assert run("base", None) == 0
    assert run("a1", ADAPTERS[0]) == 0  # the base model's blocks hold other keys and values
    assert run("a2", ADAPTERS[1]) == 0
    assert run("a1 again", ADAPTERS[0]) == 12
    assert run("base again", None) == 12
