"""Token-budget scheduler and commit: no prefill/decode phases.

``schedule(plan)`` grants every running request ``num_tokens - num_computed_tokens`` tokens
(a prefill chunk, or the one newest token) plus the draft slots the plan allows, within
``max_num_batched_tokens`` and ``max_num_seqs``, first come first served. When the KV pool
runs out, draft slots go first, then the newest running request is preempted (its blocks
freed, recomputed later from its prompt + output so far): nothing crashes, nothing is dropped.

``update_from_output`` commits what the worker decided: it appends each request's tokens one
by one through the stop checks (a stop inside an accepted run cuts the run there), rolls
``num_computed_tokens`` back past rejected drafts and frees the KV slots they used, and
finishes requests.
"""
from __future__ import annotations

import time
from collections import deque

from specdec.engine.kv_cache_manager import KVCacheManager
from specdec.engine.output_processor import OutputProcessor
from specdec.engine.request import Request, RequestStatus
from specdec.engine.scheduler_output import NewRequestData, SchedulerOutput
from specdec.spec_decode.plan import SpeculationPlan
from specdec.worker.model_runner_output import ModelRunnerOutput

NO_PLAN = SpeculationPlan()


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 enable_chunked_prefill: bool = True, stop_checker: OutputProcessor | None = None,
                 max_loras: int | None = None):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        if not enable_chunked_prefill:  # unsplittable prompts: the budget must hold the longest one
            max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        # LoRA: distinct adapters the running requests may use (every step's batch is a subset of them)
        self.max_loras = max_loras
        self.stop_checker = stop_checker or OutputProcessor(None, max_model_len)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.num_preemptions = 0
        self._sent_to_worker: set[str] = set()  # requests a worker already holds state for

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- schedule ----
    def _spec_slots(self, req: Request, wanted: int, budget: int) -> int:
        if not wanted or not req.is_decoding:
            return 0
        room_in_context = self.max_model_len - req.num_tokens
        room_in_output = req.max_tokens - req.num_output_tokens - 1
        return max(0, min(wanted, budget, room_in_context, room_in_output))

    def schedule(self, plan: SpeculationPlan | None = None) -> SchedulerOutput:
        plan = plan or NO_PLAN
        out = SchedulerOutput(tree_budget=plan.tree_budget)
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            wanted = plan.num_spec_tokens.get(req.request_id, 0)
            num_spec = self._spec_slots(req, wanted, budget - num_new) \
                if num_new == req.num_tokens - req.num_computed_tokens else 0
            while not self.kv.allocate_slots(req, num_new + num_spec):
                if num_spec:  # first give up the drafts, then preempt the newest request
                    num_spec = 0
                    continue
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                self._add_to_batch(out, req, num_new, num_spec, plan.tree_depths.get(req.request_id, 0))
                budget -= num_new + num_spec
                i += 1
        if not out.preempted_req_ids:
            self._admit_waiting(out, budget)
        return out

    def _add_to_batch(self, out: SchedulerOutput, req: Request, num_new: int, num_spec: int, depth: int) -> None:
        out.request_ids.append(req.request_id)
        out.num_computed_tokens.append(req.num_computed_tokens)
        out.num_scheduled_tokens.append(num_new)
        out.num_spec_slots.append(num_spec)
        out.tree_depths.append(depth if num_spec else 0)
        out.num_output_tokens.append(req.num_output_tokens)
        out.block_ids.append(self.kv.get_block_ids(req.request_id))
        if req.request_id not in self._sent_to_worker:
            self._sent_to_worker.add(req.request_id)
            out.new_requests.append(NewRequestData(req.request_id, req.prompt_token_ids, req.sampling_params,
                                                   req.seed, req.lora_request))

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if not self._adapter_fits(req):  # first come first served: it waits for an adapter to leave
                break
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
            self._add_to_batch(out, req, num_new, 0, 0)
            budget -= num_new

    def _adapter_fits(self, req: Request) -> bool:
        """Whether running ``req`` keeps the running requests within ``max_loras`` distinct adapters."""
        if req.lora_request is None or self.max_loras is None:
            return True
        active = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
        return req.lora_request.lora_int_id in active or len(active) < self.max_loras

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted_req_ids.append(req.request_id)

    # ---- commit ----
    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> tuple[list[Request], list[int]]:
        """Commit a step; returns the requests whose output grew (finished ones included) and,
        per scheduled request, the tokens committed."""
        now = time.monotonic()
        updated: list[Request] = []
        num_emitted: list[int] = []
        for i, rid in enumerate(sched.request_ids):
            req = self.requests[rid]
            n = sched.num_scheduled_tokens[i]
            tokens = result.sampled_token_ids[i]
            if not tokens:  # a prefill chunk that does not complete the prompt
                req.num_computed_tokens += n
                self.kv.cache_full_blocks(req)
                num_emitted.append(0)
                continue
            accepted = result.num_accepted_tokens[i]
            if result.num_draft_tokens[i]:
                req.num_drafts += 1
                req.num_draft_tokens += result.num_draft_tokens[i]
                req.num_accepted_tokens += accepted
            num_computed = req.num_computed_tokens + n + accepted  # the fed tokens + accepted drafts
            logprobs = result.logprobs[i]
            status = None
            for j, token in enumerate(tokens):
                if req.output_logprobs is not None:
                    req.output_logprobs.append(logprobs[j])
                status = self.stop_checker.append_token(req, token)
                if status is not None:
                    break
            num_emitted.append(req.num_output_tokens - sched.num_output_tokens[i])
            # a stop inside the accepted run keeps fewer tokens than were computed
            req.num_computed_tokens = min(num_computed, req.num_tokens)
            req.first_token_time = req.first_token_time or now
            req.last_token_time = now
            self.kv.cache_full_blocks(req)
            if status is not None:
                self.finish(req, status)
            else:
                self.kv.truncate(req, req.num_tokens)
            updated.append(req)
        return updated, num_emitted

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
        self.requests.pop(req.request_id, None)
        self._sent_to_worker.discard(req.request_id)
