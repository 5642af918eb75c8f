"""How many tokens to draft per request each step: a fixed K, or adaptive ("auto").

Adaptive K maximises expected tokens per second from each request's running acceptance
estimate and the measured cost of draft and target forwards (see ``adaptive.py``). The
controller's decision is data, a ``SpeculationPlan``; it learns from each step's public
``StepRecord``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from specdec.engine.request import Request
from specdec.spec_decode.plan import SpeculationPlan, TreeBudget

if TYPE_CHECKING:
    from specdec.engine.step_record import StepRecord

class SpecController:
    def __init__(self, max_k: int, adaptive: bool, draft_is_model: bool, max_model_len: int | None = None,
                 tree_slots: int = 0):
        self.max_k = max_k
        # token trees with adaptive K: a request planned to draft at depth k > 0 reserves this many
        # slots; how many nodes are verified is decided after drafting (``choose_tree_nodes``)
        self.tree_slots = tree_slots
        self.tree_calibration = 1.0  # realised / predicted accepted tokens of adaptive trees (EMA)
        self.max_model_len = max_model_len
        self.adaptive = adaptive
        self.draft_is_model = draft_is_model
        self.cost = None
        self.acceptance = None
        self.guard = None
        self._num_plain_steps = 0
        self._idle_ids: list[str] | None = None  # requests of the last plan, when it drafted nothing
        self._idle_age = 0  # steps that plan has been reused
        self._idle_limit = 4  # reuses before the next replan: doubles while replans keep drafting nothing
        self.replan_idle_every = 4
        self.replan_idle_max = 32
        self._last_ids: list[str] = []  # the decoding requests of the previous plan
        self.observe_plain_every = 8  # plain decode steps per cost-model observation
        self.explorer = None  # "auto": drafts in steps planned at K = 0, so such a plan keeps learning
        # batch bucket -> [seconds a decode step spends outside its forwards (EMA), steps seen]
        self._step_overhead: dict[int, list[float]] = {}
        self._new_k: int | None = None  # "auto": K of a new request's first drafts (``_new_request_k``)
        self._new_k_age = 0
        self.replan_new_every = 16
        if adaptive:
            from specdec.spec_decode.acceptance import AcceptanceEstimator
            from specdec.spec_decode.cost_model import StepCostModel
            from specdec.spec_decode.explorer import Explorer
            from specdec.spec_decode.throughput_guard import ThroughputGuard

            self.cost = StepCostModel()
            self.acceptance = AcceptanceEstimator()
            self.guard = ThroughputGuard()
            self.explorer = Explorer(self.acceptance, max_k, draft_is_model)

    @classmethod
    def build(cls, spec, max_model_len: int | None = None) -> SpecController:
        """The policy ``spec`` asks for; its method's entry says whether drafting costs a model forward."""
        from specdec.spec_decode.methods import get_method

        adaptive_tree = spec.is_tree and spec.is_adaptive
        return cls(spec.max_k if adaptive_tree else spec.num_spec_slots, spec.is_adaptive,
                   get_method(spec.method).has_draft_model, max_model_len,
                   tree_slots=spec.num_spec_slots if adaptive_tree else 0)

    @classmethod
    def fixed(cls, k: int) -> SpecController:
        """A policy that plans ``k`` drafts for every decoding request and learns nothing."""
        return cls(k, adaptive=False, draft_is_model=False)

    def calibrate(self, time_forward, time_shape=None, batch_sizes: tuple[int, ...] = ()) -> None:
        """Time a few forwards at several token counts so the first steps already have a cost
        model (``time_forward(kind, num_tokens) -> seconds``: the worker's). With ``time_shape``
        (``(num_requests, rows_per_request) -> seconds``, the worker's verification-shaped pass)
        and ``batch_sizes``, the target is priced on every batch size x 1..max_k + 1 rows instead:
        a mixture-of-experts target's pass costs what its rows' expert union costs, which grows
        with each row until every expert is read, so its v(K) bends where a dense model's is
        nearly flat, and the bend is where "auto" must stop drafting.

        A dense target (no ``batch_sizes``) is priced on one request's 1..max_k + 1 rows too, one
        knot per row count: a CPU whose matrix kernel changes with the rows (AMX from a measured
        row count on, ``layers.cpu_kernel_choice.a8_amx_min_rows``) makes v(K) a step function,
        which knots at 1, 2, 4, 8 rows would smooth into a slope and misprice every K in between."""
        if time_shape is not None:
            from specdec.spec_decode.cost_model import StepCostModel, shape_token_counts, verification_shapes

            shapes = verification_shapes(batch_sizes or (1,), self.max_k + 1)
            self.cost = StepCostModel(shape_token_counts(shapes), self.cost.ema_rate)
            self.cost.calibrate_shapes(time_shape, shapes)
            if not batch_sizes:  # larger decode batches: one row per request, as they run
                covered = {batch * rows for batch, rows in shapes}
                for n in (2, 4, 8, 16, 32, 64):
                    if n not in covered:
                        self.cost.set("target", n, time_forward("target", n))
        else:
            for n in (1, 2, 4, 8, 16, 32, 64):
                self.cost.set("target", n, time_forward("target", n))
        for n in (1, 2, 4, 8, 16, 32, 64):
            self.cost.set("draft", n, time_forward("draft", n))

    def plan(self, running: list[Request], closed_batch: bool = False) -> SpeculationPlan:
        """The drafts each running request may verify this step (0: decode normally; prefill
        chunks and requests that opted out always get 0), in one pass over the batch.
        ``closed_batch``: nothing will join the running requests (an offline ``generate`` whose
        queue is empty), so the plan values the batch's completion."""
        if not self.adaptive:
            return SpeculationPlan({r.request_id: self.max_k for r in running
                                    if r.sampling_params.use_speculation and r.is_decoding},
                                   new_request_spec_tokens=self.max_k)
        plan = self._replan(running, closed_batch)
        new_k = self._new_request_k(len(running))
        if not self.tree_slots:
            return SpeculationPlan(plan, new_request_spec_tokens=new_k)
        depths = {rid: k for rid, k in plan.items() if k}
        budget = None
        if depths or new_k:  # new requests draft trees too, sized by the same budget
            base_rows = sum(r.num_tokens - r.num_computed_tokens for r in running)
            max_nodes = self.tree_slots * max(1, len(running))
            budget = TreeBudget(base_rows, self.tree_calibration,
                                self.cost.costs("target", base_rows + np.arange(max_nodes + 1), len(running)))
        return SpeculationPlan(dict.fromkeys(depths, self.tree_slots), depths, budget,
                               new_request_spec_tokens=self.tree_slots if new_k else 0)

    def _new_request_k(self, num_running: int) -> int:
        """K for the first drafts of a request whose prompt completes this step (not in the plan:
        it was prefilling, or is admitted now): the choice for an unseen request, one that reads
        the pooled acceptance, decoding beside the running ones; refreshed every
        ``replan_new_every`` plans (it moves only as the pooled estimate does)."""
        if self._new_k is not None and self._new_k_age < self.replan_new_every:
            self._new_k_age += 1
            return self._new_k
        from specdec.spec_decode.adaptive import choose_num_spec_tokens

        alphas = self.acceptance.unseen_position_acceptance()[None]
        k = choose_num_spec_tokens(alphas, self.max_k, self.cost, num_other_tokens=num_running,
                                   draft_per_token=self.draft_is_model,
                                   step_overhead=self.step_overhead(num_running + 1),
                                   num_requests=num_running + 1)[0]
        self._new_k, self._new_k_age = k, 0
        return k

    def remaining_budget(self, req: Request) -> int:
        """Tokens ``req`` may still generate: max_tokens, and the context limit."""
        left = req.max_tokens - req.num_output_tokens
        if self.max_model_len is not None:
            left = min(left, self.max_model_len - req.num_tokens)
        return left

    def _replan(self, running: list[Request], closed_batch: bool = False) -> dict[str, int]:
        from specdec.spec_decode.adaptive import (
            choose_num_spec_tokens,
            completion_weights,
        )

        reqs, others, prefilling = [], 0, False
        for r in running:  # one pass: this runs every step
            decoding = r.is_decoding
            if decoding and r.sampling_params.use_speculation:
                reqs.append(r)
            else:  # rows of the same pass that never draft: prefill chunks, decode rows that opted out
                others += r.num_tokens - r.num_computed_tokens
                prefilling = prefilling or not decoding
        num_requests = len(running)  # the pass's requests: its batch bucket prices the rows
        ids = [r.request_id for r in reqs]
        if ids and ids != self._last_ids:  # (a list compare: the batch rarely changes)
            new = len(set(ids).difference(self._last_ids))
            self._last_ids = ids
            self.guard.requests_changed(len(ids), new / len(ids))
        if not reqs:
            ks = []
        elif not prefilling and not self.guard.allow(len(reqs)):
            # speculating steps have been slower lately, or the guard samples a plain step; only
            # in the first case can the text have changed unseen since (the guard probes rarely)
            ks = [0] * len(reqs)
            if self.guard.backing_off(len(reqs)):
                ks = self._explore(ids, others, num_requests) or ks
        elif not prefilling and ids == self._idle_ids and self._idle_age < self._idle_limit:
            # the last plan drafted nothing for these same requests and no acceptance has been
            # observed since: the next few would say the same (planning is not free at large batches)
            self._idle_age += 1
            ks = [0] * len(reqs)
        else:
            weights = None
            if closed_batch:
                # a token of a request that will finish before the batch does buys nothing but a
                # costlier step (see completion_weights); the request that ends the batch counts fully
                weight = dict(zip((r.request_id for r in running),
                                  completion_weights([self.remaining_budget(r) for r in running])))
                weights = [weight[r.request_id] for r in reqs]
            # per-position conditional acceptance: copy-style proposers accept in bursts
            alphas = self.acceptance.position_acceptances(ids)
            # the drafts planned now are verified next step, after this step emits at least one
            # token: a request with r tokens left then has at most r - 1, so the scheduler grants
            # no draft past r - 2 (``Scheduler._next_slots``); valued at 0 here, the batch's other
            # requests are planned for the draft passes and rows the step will really run
            ending = 0
            for row, r in enumerate(reqs):
                left = self.remaining_budget(r)
                if left <= alphas.shape[1] + 1:
                    alphas[row, max(0, left - 2):] = 0.0
                    ending += left <= 2
            ks = choose_num_spec_tokens(alphas, self.max_k, self.cost, num_other_tokens=others,
                                        draft_per_token=self.draft_is_model, weights=weights,
                                        step_overhead=self.step_overhead(len(reqs)), num_requests=num_requests)
            if not any(ks) and not prefilling and ending < len(reqs):
                # a plan at K = 0 learns nothing unless it explores now and then
                ks = self._explore(ids, others, num_requests) or ks
            if not any(ks) and not prefilling:
                # the same requests, no acceptance seen, and again nothing to draft: the costs alone
                # drift too slowly to change that, so look less often
                again = ids == self._idle_ids
                self._idle_limit = min(2 * self._idle_limit, self.replan_idle_max) if again else self.replan_idle_every
                self._idle_ids, self._idle_age = ids, 0
            else:
                self._idle_ids, self._idle_age = None, 0
        return dict(zip(ids, ks))

    def _explore(self, ids: list[str], num_other_tokens: int, num_requests: int) -> list[int] | None:
        return self.explorer.plan(ids, num_other_tokens, self.cost, self.step_overhead(len(ids)), num_requests)

    def observe(self, record: StepRecord) -> None:
        """Learn from a finished step: acceptance per request, step costs, realised throughput."""
        if self.acceptance is None:
            return
        for rid, _, num_positions, num_accepted in record.drafts():
            self.acceptance.update(rid, num_positions, num_accepted)
            self._idle_ids, self._idle_limit = None, self.replan_idle_every
        result = record.result
        self.acceptance.age([rid for rid, n in zip(result.request_ids, result.num_draft_tokens) if not n])
        if not any(result.num_draft_tokens):
            self.acceptance.age_pooled()
        self.explorer.observe(record, self.cost)
        self._observe_costs(record)
        self._observe_outcome(record)

    def _observe_costs(self, record: StepRecord) -> None:
        sched, result = record.scheduled, record.result
        drafted = result.num_draft_tokens
        verified_drafts = sum(1 for n in drafted if n)
        # the rows the target really ran: a proposer may fill fewer draft slots than were reserved
        # (suffix / n-gram with no match), and pricing the reserved count would make big steps look cheap
        num_rows = sum(sched.num_scheduled_tokens) + sum(drafted)
        if not verified_drafts and num_rows == len(sched.request_ids):
            # plain decode steps repeat one shape: a sample of them keeps that knot current
            self._num_plain_steps += 1
            if self._num_plain_steps % self.observe_plain_every:
                return
        self.cost.observe("target", num_rows, result.target_seconds, len(sched.request_ids))
        # the step's proposal (the next step's drafts): a first pass that caught up on a whole prompt
        # (the step that computed it) costs many passes: read as the price of every pass it would say
        # drafting never pays, and with nothing drafted no later step would correct it
        num_drafting = sum(1 for d in result.draft_token_ids if d)
        if (num_drafting and self.draft_is_model and result.num_draft_passes
                and result.num_draft_first_pass_rows <= 2 * num_drafting):
            self.cost.observe("draft", num_drafting, result.draft_seconds / result.num_draft_passes)

    def step_overhead(self, num_decoding: int) -> float:
        """Seconds a decode step of ``num_decoding`` requests spends outside its forwards (0 until seen)."""
        stats = self._step_overhead.get(self.guard.bucket(num_decoding))
        return stats[0] if stats else 0.0

    def _observe_outcome(self, record: StepRecord) -> None:
        """A whole step's tokens and wall time, for the throughput guard (pure decode/verify steps only)."""
        sched, result = record.scheduled, record.result
        if any(n != 1 for n in sched.num_scheduled_tokens):
            return
        overhead = record.step_seconds - result.target_seconds - result.draft_seconds
        if overhead >= 0.0:  # a step's part that does not grow with its rows: paid once per step
            stats = self._step_overhead.setdefault(self.guard.bucket(len(sched.request_ids)), [0.0, 0])
            stats[0] += max(0.05, 1.0 / (stats[1] + 1)) * (overhead - stats[0])
            stats[1] += 1
        num_emitted = record.total_emitted_tokens
        if result.expected_accepted:  # adaptive trees: how well the draft's probabilities predict acceptance
            ratio = (num_emitted - len(sched.request_ids)) / result.expected_accepted
            self.tree_calibration = min(2.0, max(0.5, 0.95 * self.tree_calibration + 0.05 * ratio))
        # in realised tokens/s whatever the plan's weights: the guard is the check on reality
        self.guard.observe(len(sched.request_ids), any(result.num_draft_tokens), num_emitted, record.step_seconds)

    def forget(self, req: Request) -> None:
        if self.acceptance is not None:
            self.acceptance.forget(req.request_id)
