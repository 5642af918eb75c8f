"""Token-budget scheduler and commit: no prefill/decode phases.

``schedule(plan)`` grants every running request ``num_tokens - num_computed_tokens`` tokens
(a prefill chunk, or the one newest token) plus the drafts the worker proposed for it at the
end of the last step, within ``max_num_batched_tokens`` and ``max_num_seqs``, first come first
served, and reserves KV slots for the drafts the plan lets the worker propose at the end of
this step (the newest token's slot and one per draft). When the KV pool runs out, that
reservation goes first, then the drafts, then the newest running request is preempted (its
blocks freed, recomputed later from its prompt + output so far): nothing crashes, nothing is
dropped.

``update_from_output`` commits what the worker decided: it appends each request's tokens one
by one through the stop checks (a stop inside an accepted run cuts the run there), rolls
``num_computed_tokens`` back past rejected drafts, keeps the worker's next drafts and frees
the KV slots past them, and finishes requests.
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

    def _next_slots(self, req: Request, plan: SpeculationPlan) -> int:
        """Drafts the worker may propose for ``req`` at the end of a step that completes its prompt."""
        if not req.sampling_params.use_speculation:
            return 0
        wanted = plan.num_spec_tokens.get(req.request_id)
        if wanted is None:
            wanted = plan.new_request_spec_tokens
        # the step emits at least one token; one more for the next step's own
        return max(0, min(wanted, self.max_model_len - req.num_tokens - 1, req.max_tokens - req.num_output_tokens - 2))

    def schedule(self, plan: SpeculationPlan | None = None) -> SchedulerOutput:
        plan = plan or NO_PLAN
        out = SchedulerOutput(tree_budget=plan.tree_budget)
        budget = self.max_num_batched_tokens
        # without any drafts planned no request reserves slots for the next ones
        plans_drafts = bool(plan.num_spec_tokens) or plan.new_request_spec_tokens > 0
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_left = req.num_tokens - req.num_computed_tokens
            num_new = min(num_left, budget)
            completes = num_new == num_left
            num_spec = self._spec_slots(req, len(req.spec_token_ids), budget - num_new) \
                if completes and req.spec_token_ids else 0
            num_next = self._next_slots(req, plan) if completes and plans_drafts else 0
            # the next drafts' slots: the newest token's and one per draft (the worker writes draft KV there)
            while not self.kv.allocate_slots(req, num_new + num_spec + (num_next + 1 if num_next else 0)):
                if num_next:  # first give up the next drafts, then this step's, then preempt the newest request
                    num_next = 0
                    continue
                if num_spec:
                    num_spec = 0
                    continue
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                self._add_to_batch(out, req, num_new, req.spec_token_ids[:num_spec], num_next,
                                   plan.tree_depths.get(req.request_id, 0))
                budget -= num_new + num_spec
                i += 1
        if not out.preempted_req_ids:
            self._admit_waiting(out, budget, plan)
        return out

    def _add_to_batch(self, out: SchedulerOutput, req: Request, num_new: int, drafts: list[int], num_next: int,
                      depth: int) -> None:
        req.spec_token_ids = []  # verified this step, or dropped
        out.request_ids.append(req.request_id)
        out.num_computed_tokens.append(req.num_computed_tokens)
        out.num_scheduled_tokens.append(num_new)
        out.spec_token_ids.append(drafts)
        out.num_spec_slots.append(num_next)
        out.tree_depths.append(depth if num_next else 0)
        out.num_output_tokens.append(req.num_output_tokens)
        out.block_ids.append(self.kv.get_block_ids(req.request_id))
        out.group_block_ids.append(self.kv.get_group_block_ids(req.request_id))
        if req.request_id not in self._sent_to_worker:
            self._sent_to_worker.add(req.request_id)
            out.new_requests.append(NewRequestData(req.request_id, req.prompt_token_ids, req.sampling_params,
                                                   req.seed, req.lora_request))

    def _admit_waiting(self, out: SchedulerOutput, budget: int, plan: SpeculationPlan) -> None:
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
            completes = num_new == req.num_tokens - num_hit
            num_next = self._next_slots(req, plan) if completes and plan.new_request_spec_tokens else 0
            if not self.kv.allocate_slots(req, num_new + (num_next + 1 if num_next else 0), computed_blocks):
                if not num_next or not self.kv.allocate_slots(req, num_new, computed_blocks):
                    break
                num_next = 0
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            req.num_cached_prompt_tokens = num_hit
            self.running.append(req)
            self._add_to_batch(out, req, num_new, [], num_next, plan.tree_depths.get(req.request_id, 0))
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
        req.spec_token_ids = []
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
        append_token = self.stop_checker.append_token
        no_drafts = [[]] * len(sched.request_ids)
        for rid, n, num_output, tokens, drafts, num_drafted, accepted, logprobs in zip(
                sched.request_ids, sched.num_scheduled_tokens, sched.num_output_tokens, result.sampled_token_ids,
                result.draft_token_ids or no_drafts, result.num_draft_tokens, result.num_accepted_tokens,
                result.logprobs, strict=True):
            req = self.requests[rid]
            if not tokens:  # a prefill chunk that does not complete the prompt
                req.num_computed_tokens += n
                self.kv.cache_full_blocks(req)
                num_emitted.append(0)
                continue
            if num_drafted:
                req.num_drafts += 1
                req.num_draft_tokens += num_drafted
                req.num_accepted_tokens += accepted
            num_computed = req.num_computed_tokens + n + accepted  # the fed tokens + accepted drafts
            status = None
            for j, token in enumerate(tokens):
                if req.output_logprobs is not None:
                    req.output_logprobs.append(logprobs[j])
                status = append_token(req, token)
                if status is not None:
                    break
            num_emitted.append(req.num_output_tokens - num_output)
            # a stop inside the accepted run keeps fewer tokens than were computed
            num_tokens = req.num_tokens
            req.num_computed_tokens = min(num_computed, num_tokens)
            req.first_token_time = req.first_token_time or now
            req.last_token_time = now
            self.kv.cache_full_blocks(req)
            if status is not None:
                self.finish(req, status)
            else:
                # the drafts are kept only while the worker's tokens are the request's: a stop
                # finishes the request, so a kept run always is
                req.spec_token_ids = list(drafts) if drafts and num_tokens - req.num_computed_tokens == 1 else []
                if drafts:  # the draft caught up on every token before proposing them
                    self.kv.mark_draft_caught_up(req)
                self.kv.truncate(req, num_tokens + len(req.spec_token_ids))
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
