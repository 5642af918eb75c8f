"""Token-budget scheduler: no prefill/decode phases.

Every running request is granted ``num_tokens - num_computed_tokens`` tokens (a prefill
chunk, or the one newest token) plus the draft slots it wants (``num_spec_tokens_wanted``),
within ``max_num_batched_tokens`` and ``max_num_seqs``, first come first served. When the
KV pool runs out, the newest running request is preempted (its blocks freed, recomputed
later from its prompt + output so far): nothing crashes, nothing is dropped.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from specdec.engine.kv_cache_manager import KVCacheManager
from specdec.engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    requests: list[Request]  # batch order
    num_scheduled_tokens: list[int]  # per request: prefill chunk or 1, excluding draft slots
    num_spec_slots: list[int]  # per request: draft slots reserved (K for decoding requests)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens) + sum(self.num_spec_slots)

    @property
    def is_empty(self) -> bool:
        return not self.requests


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 enable_chunked_prefill: bool = True):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        if not enable_chunked_prefill:  # unsplittable prompts: the budget must hold the longest one
            max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _spec_slots(self, req: Request, budget: int) -> int:
        if not req.is_decoding:
            return 0
        room_in_context = self.max_model_len - req.num_tokens
        room_in_output = req.max_tokens - req.num_output_tokens - 1
        return max(0, min(req.num_spec_tokens_wanted, budget, room_in_context, room_in_output))

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput([], [], [])
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            num_spec = self._spec_slots(req, budget - num_new) if num_new == req.num_tokens - req.num_computed_tokens else 0
            while not self.kv.allocate_slots(req, num_new + num_spec):
                if num_spec:  # first give up the drafts, then preempt the newest request
                    num_spec = 0
                    continue
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.requests.append(req)
                out.num_scheduled_tokens.append(num_new)
                out.num_spec_slots.append(num_spec)
                budget -= num_new + num_spec
                i += 1
        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            computed_blocks, num_hit = self.kv.get_computed_blocks(req)
            num_new = req.num_tokens - num_hit
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break
                num_new = budget
            if not self.kv.allocate_slots(req, num_new, computed_blocks):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            req.num_cached_prompt_tokens = num_hit
            self.running.append(req)
            out.requests.append(req)
            out.num_scheduled_tokens.append(num_new)
            out.num_spec_slots.append(0)
            budget -= num_new

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_draft_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Mark finished and free its blocks (also used for aborts, from any state)."""
        req.status = status
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.kv.free(req)
