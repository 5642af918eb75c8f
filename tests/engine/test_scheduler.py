"""Scheduler + KV manager under random add / step / abort sequences, with a fake worker.

The fake worker stands in for the model: it decides random speculative outcomes and returns
them as a ``ModelRunnerOutput``, which the real ``Scheduler.update_from_output`` commits. It
also keeps a fake KV cache: every slot a step computes records the (position, token) it holds.
Before each step every request's computed positions must still hold its own tokens; that
catches a prefix-cache hit on the wrong block, a block freed or evicted while still in use,
and a bad truncation.
"""
from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.engine.kv_cache_manager import KVCacheManager
from specdec.engine.output_processor import OutputProcessor
from specdec.engine.request import Request, RequestStatus
from specdec.engine.scheduler import Scheduler
from specdec.sampling_params import SamplingParams
from specdec.spec_decode.plan import SpeculationPlan
from specdec.worker.model_runner_output import ModelRunnerOutput

BS = 4
VOCAB = 6  # small, so random prompts share prefixes and prefix-cache hits happen
STOP_TOKEN = 5
SHARED_PREFIXES = [[1, 2, 3, 4, 1, 2, 3, 4, 0, 0, 1], [2, 2, 2, 2, 3, 3, 3, 3]]


class FakeEngine:
    def __init__(self, num_blocks: int, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 seed: int, enable_chunked_prefill: bool = True, enable_prefix_caching: bool = True):
        self.kv = KVCacheManager(num_blocks, BS, enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, max_num_seqs, max_num_batched_tokens, max_model_len, enable_chunked_prefill,
                                   stop_checker=OutputProcessor(tokenizer=None, max_model_len=max_model_len))
        self.rng = random.Random(seed)
        self.kv_content: dict[int, tuple[int, int]] = {}  # slot -> (position, token)
        self.requests: list[Request] = []
        self.worker_tokens: dict[str, list[int]] = {}  # the fake worker's own copy of each request's tokens
        self.pending: dict[str, list[int]] = {}  # the fake worker's drafts for each request's next step
        self.num_steps = 0

    # ---- the engine's side of the contract ----
    def add(self, prompt: list[int], max_tokens: int, stop: bool) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=[STOP_TOKEN] if stop else None)
        r = Request(f"r{len(self.requests)}", prompt, params)
        self.requests.append(r)
        self.scheduler.add_request(r)

    def abort(self, index: int) -> None:
        if self.requests:
            r = self.requests[index % len(self.requests)]
            if not r.is_finished:
                self.scheduler.finish(r, RequestStatus.FINISHED_ABORTED)
                self.sync_worker()

    def step(self) -> None:
        plan = SpeculationPlan({r.request_id: self.rng.randint(0, 4) for r in self.scheduler.running if r.is_decoding},
                               new_request_spec_tokens=self.rng.randint(0, 3))
        sched = self.scheduler.schedule(plan)
        self.num_steps += 1
        self.check_schedule(sched)
        result = self.fake_worker(sched)
        before = {rid: self.scheduler.requests[rid].num_output_tokens for rid in sched.request_ids}
        updated, num_emitted = self.scheduler.update_from_output(sched, result)
        for rid, emitted, tokens in zip(sched.request_ids, num_emitted, result.sampled_token_ids):
            assert 0 <= emitted <= len(tokens)  # a stop may cut the run, never lengthen it
            req = next(r for r in self.requests if r.request_id == rid)
            assert req.num_output_tokens - before[rid] == emitted
            assert req.output_token_ids[before[rid]:] == tokens[:emitted]
        assert {r.request_id for r in updated} == {rid for rid, t in zip(sched.request_ids, result.sampled_token_ids) if t}
        self.sync_worker()
        self.check_state()

    def fake_worker(self, sched) -> ModelRunnerOutput:
        """Random acceptance of the scheduled drafts, then random next drafts (as many as the
        scheduler granted, at most); writes the fake KV of every fed row."""
        for new in sched.new_requests:
            self.worker_tokens[new.request_id] = list(new.prompt_token_ids)
        out = ModelRunnerOutput(request_ids=sched.request_ids)
        for rid, start, n, drafts, num_next, blocks in zip(sched.request_ids, sched.num_computed_tokens,
                                                           sched.num_scheduled_tokens, sched.spec_token_ids,
                                                           sched.num_spec_slots, sched.block_ids):
            pending = self.pending.pop(rid, [])
            assert drafts == pending[:len(drafts)]  # the worker's own drafts, or a prefix of them
            tokens = self.worker_tokens[rid]
            k = len(drafts)
            fed = tokens[start:start + n] + drafts
            for pos, tok in zip(range(start, start + len(fed)), fed):
                self.kv_content[blocks[pos // BS] * BS + pos % BS] = (pos, tok)
            sampled, accepted, proposed = [], 0, []
            if start + n == len(tokens):  # not a partial prefill chunk
                accepted = self.rng.randint(0, k)
                sampled = drafts[:accepted] + [self.rng.randrange(VOCAB)]
                tokens.extend(sampled)
                if num_next:
                    # the slots reserved hold the newest token and every next draft
                    assert len(blocks) * BS >= len(tokens) + num_next
                    proposed = [self.rng.randrange(VOCAB) for _ in range(self.rng.randint(0, num_next))]
                    self.pending[rid] = proposed
            out.sampled_token_ids.append(sampled)
            out.draft_token_ids.append(proposed)
            out.num_draft_tokens.append(k if sampled else 0)
            out.num_accepted_tokens.append(accepted)
            out.num_draft_positions.append(k if sampled else 0)
            out.logprobs.append(None)
        return out

    def sync_worker(self) -> None:
        """What EngineCore tells the worker when requests finish: drop its copies."""
        for rid in list(self.worker_tokens):
            if rid not in self.scheduler.requests:
                del self.worker_tokens[rid]
                self.pending.pop(rid, None)

    # ---- invariants ----
    def check_schedule(self, sched) -> None:
        s = self.scheduler
        assert sched.total_num_tokens <= s.max_num_batched_tokens
        assert len(sched.request_ids) <= s.max_num_seqs and len(s.running) <= s.max_num_seqs
        assert len(set(sched.request_ids)) == len(sched.request_ids)
        reqs = [s.requests[rid] for rid in sched.request_ids]
        for r, n, drafts, num_next, start, blocks in zip(reqs, sched.num_scheduled_tokens, sched.spec_token_ids,
                                                         sched.num_spec_slots, sched.num_computed_tokens,
                                                         sched.block_ids):
            k = len(drafts)
            assert r.status == RequestStatus.RUNNING and r in s.running
            assert start == r.num_computed_tokens and blocks == self.kv.get_block_ids(r.request_id)
            assert n >= 1 and r.num_computed_tokens + n <= r.num_tokens
            assert k == 0 or r.num_computed_tokens + n == r.num_tokens  # drafts only after the last real token
            assert num_next == 0 or r.num_computed_tokens + n == r.num_tokens  # next drafts only after a decision
            assert r.num_output_tokens + k + 1 <= r.max_tokens  # never drafts past max_tokens
            assert num_next == 0 or r.num_output_tokens + 1 + num_next + 1 <= r.max_tokens  # nor next drafts
            assert len(self.kv.get_block_ids(r.request_id)) * BS >= r.num_computed_tokens + n + k
            # every computed position still holds this request's own token (prefix hits included)
            blocks = self.kv.get_block_ids(r.request_id)
            for pos in range(r.num_computed_tokens):
                assert self.kv_content.get(blocks[pos // BS] * BS + pos % BS) == (pos, r.all_token_ids[pos]), (
                    f"{r.request_id} position {pos} lost its KV")
        for rid in sched.preempted_req_ids:
            r = s.requests[rid]
            assert r.status == RequestStatus.PREEMPTED and r.num_computed_tokens == 0 and r in s.waiting
        # the worker learns each request once, when it is first scheduled (not again after a preemption)
        assert all(new.request_id not in self.worker_tokens for new in sched.new_requests)

    def check_state(self) -> None:
        pool, s = self.kv.pool, self.scheduler
        holders = [0] * pool.num_blocks
        for blocks in self.kv.req_blocks.values():
            for b in blocks:
                holders[b.block_id] += 1
        for block in pool.blocks:
            assert block.ref_cnt >= 0
            assert block.ref_cnt == holders[block.block_id], f"{block!r} has {holders[block.block_id]} holders"
            assert (block.ref_cnt == 0) == (block.block_id in pool.free_queue)
        for h, block in pool.cached.items():
            assert block.block_hash == h
        assert not set(map(id, s.waiting)) & set(map(id, s.running))
        for r in s.waiting:
            assert not self.kv.get_block_ids(r.request_id), "a waiting request holds blocks"
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        for r in self.requests:
            if r.is_finished:
                assert r.request_id not in self.kv.req_blocks
                assert r.num_output_tokens <= r.max_tokens

    def drain(self, max_steps: int = 2000) -> None:
        steps = 0
        while self.scheduler.has_unfinished():
            self.step()
            steps += 1
            assert steps < max_steps, "requests never finished"
        assert all(r.is_finished for r in self.requests)
        assert self.kv.pool.num_free_blocks == self.kv.pool.num_blocks
        assert self.kv.req_blocks == {} and all(b.ref_cnt == 0 for b in self.kv.pool.blocks)


prompt_strategy = st.tuples(
    st.sampled_from([None, 0, 0, 1]),  # which shared prefix (None: random prompt)
    st.integers(1, 11),  # how much of the shared prefix
    st.lists(st.integers(0, VOCAB - 2), min_size=1, max_size=12),  # the rest (no stop token in prompts)
)
add_strategy = st.tuples(st.just("add"), prompt_strategy, st.integers(1, 14), st.booleans())
op_strategy = st.one_of(add_strategy, add_strategy, st.tuples(st.just("step")), st.tuples(st.just("abort"), st.integers(0, 50)))
PROPERTY_SETTINGS = settings(max_examples=100, derandomize=True, deadline=None, database=None,
                             suppress_health_check=[HealthCheck.too_slow])


def run_ops(engine: FakeEngine, ops) -> None:
    for op in ops:
        if op[0] == "add":
            (which, prefix_len, rest), max_tokens, stop = op[1:]
            prompt = (SHARED_PREFIXES[which][:prefix_len] if which is not None else []) + rest
            engine.add(prompt, max_tokens, stop)
        elif op[0] == "step":
            engine.step()
        else:
            engine.abort(op[1])
    engine.drain()


@PROPERTY_SETTINGS
@given(
    ops=st.lists(op_strategy, min_size=10, max_size=50),
    num_blocks=st.integers(8, 16),
    max_num_seqs=st.integers(1, 8),
    max_num_batched_tokens=st.integers(8, 40),
    seed=st.integers(0, 2**16),
)
def test_random_add_step_abort_keeps_every_invariant(ops, num_blocks, max_num_seqs, max_num_batched_tokens, seed):
    # max_model_len 32 + up to 4 drafts + 1 fits in 8 blocks of 4: one request always fits alone
    engine = FakeEngine(num_blocks, max_num_seqs, max_num_batched_tokens, max_model_len=27, seed=seed)
    run_ops(engine, ops)


@settings(max_examples=15, derandomize=True, deadline=None, database=None)
@given(ops=st.lists(op_strategy, max_size=30), seed=st.integers(0, 2**16))
def test_without_chunked_prefill_or_prefix_caching(ops, seed):
    engine = FakeEngine(12, 4, 27, max_model_len=27, seed=seed, enable_chunked_prefill=False,
                        enable_prefix_caching=False)
    run_ops(engine, ops)


def test_tiny_pool_preempts_and_every_request_still_finishes():
    engine = FakeEngine(num_blocks=8, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=27, seed=0)
    rng = random.Random(1)
    for _ in range(8):
        engine.add([rng.randrange(VOCAB - 1) for _ in range(rng.randint(4, 12))], max_tokens=12, stop=False)
    engine.drain()
    assert engine.scheduler.num_preemptions > 0
    assert any(r.num_preemptions > 0 for r in engine.requests)
    assert all(r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 12 for r in engine.requests)


def test_chunked_prefill_splits_a_long_prompt_by_the_budget():
    engine = FakeEngine(num_blocks=16, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=40, seed=0)
    engine.add(list(range(5)) * 4, max_tokens=2, stop=False)  # 20 tokens
    chunks = []
    while engine.requests[0].num_output_tokens == 0:
        before = engine.requests[0].num_computed_tokens
        engine.step()
        chunks.append(engine.requests[0].num_computed_tokens - before)
    assert chunks == [8, 8, 4]
    engine.drain()


def test_prefix_hit_skips_the_cached_blocks():
    engine = FakeEngine(num_blocks=16, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=40, seed=0)
    engine.add([1, 2, 3, 4, 1, 2, 3, 4, 0], max_tokens=1, stop=False)
    engine.drain()
    engine.add([1, 2, 3, 4, 1, 2, 3, 4, 3, 3], max_tokens=1, stop=False)
    sched = engine.scheduler.schedule()
    assert sched.num_scheduled_tokens == [2] and engine.requests[1].num_cached_prompt_tokens == 8


def test_without_chunked_prefill_a_prompt_over_the_budget_is_still_admitted():
    """The budget must grow to max_model_len when prompts cannot be split, or the request waits forever."""
    engine = FakeEngine(num_blocks=16, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=40, seed=0,
                        enable_chunked_prefill=False)
    engine.add(list(range(5)) * 4, max_tokens=3, stop=False)
    engine.drain(max_steps=20)
    assert engine.requests[0].num_output_tokens == 3


def test_abort_from_waiting_and_running_frees_everything():
    engine = FakeEngine(num_blocks=16, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=40, seed=0)
    engine.add([1, 2, 3, 4, 5], max_tokens=10, stop=False)
    engine.add([1, 2, 3], max_tokens=10, stop=False)
    engine.step()
    assert engine.requests[0].status == RequestStatus.RUNNING
    assert engine.requests[1].status == RequestStatus.WAITING
    engine.abort(1)
    engine.abort(0)
    assert not engine.scheduler.has_unfinished()
    assert engine.kv.pool.num_free_blocks == 16
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in engine.requests)
