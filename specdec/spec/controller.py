"""How many tokens to draft per request each step: a fixed K, or adaptive ("auto").

Adaptive K maximises expected tokens per second from each request's running acceptance
estimate and the measured cost of draft and target forwards (see ``specdec.spec.adaptive``).
"""
from __future__ import annotations

from specdec.engine.request import Request


class SpecController:
    def __init__(self, max_k: int, adaptive: bool, draft_is_model: bool, max_model_len: int | None = None,
                 tree_slots: int = 0):
        self.max_k = max_k
        # token trees with adaptive K: a request planned to draft at depth k > 0 reserves this many
        # slots; how many nodes are verified is decided after drafting (``choose_tree_nodes``)
        self.tree_slots = tree_slots
        self.tree_calibration = 1.0  # realised / predicted accepted tokens of adaptive trees (EMA)
        self._base_rows = 0  # rows of this step without drafts (decode rows + prefill chunks)
        self.max_model_len = max_model_len
        self.adaptive = adaptive
        self.draft_is_model = draft_is_model
        self.cost = None
        self.acceptance = None
        self.guard = None
        self._plan: dict[str, int] = {}
        self._num_plain_steps = 0
        self._idle_ids: list[str] | None = None  # requests of the last plan, when it drafted nothing
        self._idle_age = 0  # steps that plan has been reused
        self._idle_limit = 4  # reuses before the next replan: doubles while replans keep drafting nothing
        self.replan_idle_every = 4
        self.replan_idle_max = 32
        self._last_ids: list[str] = []  # the decoding requests of the previous plan
        self.observe_plain_every = 8  # plain decode steps per cost-model observation
        if adaptive:
            from specdec.spec.adaptive import AcceptanceEstimator, StepCostModel, ThroughputGuard

            self.cost = StepCostModel()
            self.acceptance = AcceptanceEstimator()
            self.guard = ThroughputGuard()

    @classmethod
    def build(cls, spec, proposer, runner, draft_runner, cfg, max_model_len: int | None = None) -> SpecController:
        adaptive_tree = spec.is_tree and spec.is_adaptive
        ctl = cls(spec.max_k if adaptive_tree else spec.num_spec_slots, spec.is_adaptive, proposer.has_draft_model,
                  max_model_len, tree_slots=spec.num_spec_slots if adaptive_tree else 0)
        if adaptive_tree:
            proposer.choose_nodes = ctl.choose_tree_nodes
        if ctl.adaptive and cfg.spec_cost_calibration:
            ctl.calibrate(runner, draft_runner)
        return ctl

    def calibrate(self, runner, draft_runner) -> None:
        """Time a few forwards at several token counts so the first steps already have a cost model."""
        from specdec.runtime.calibrate import time_forward

        counts = [1, 2, 4, 8, 16, 32, 64]
        for n in counts:
            self.cost.set("target", n, time_forward(runner, n))
            self.cost.set("draft", n, time_forward(draft_runner, n) if draft_runner is not None else 0.0)

    def plan(self, running: list[Request], closed_batch: bool = False) -> None:
        """Set ``num_spec_tokens_wanted`` on every running request for this step (0: decode
        normally; prefill chunks and requests that opted out always get 0). One pass per step:
        at batch 32 the per-request calls it replaced cost 0.4% of a step that drafts nothing."""
        if not self.adaptive:
            for r in running:
                r.num_spec_tokens_wanted = self.max_k if r.sampling_params.use_speculation and r.is_decoding else 0
            return
        self._replan(running, closed_batch)
        plan = self._plan
        if self.tree_slots:
            self._base_rows = sum(r.num_tokens - r.num_computed_tokens for r in running)
            for r in running:
                r.spec_depth_wanted = plan.get(r.request_id, 0)
                r.num_spec_tokens_wanted = self.tree_slots if r.spec_depth_wanted else 0
            return
        for r in running:
            r.num_spec_tokens_wanted = plan.get(r.request_id, 0)

    def num_tokens_for(self, req: Request, running: list[Request], closed_batch: bool = False) -> int:
        """K for ``req`` this step (``plan`` for one request). ``closed_batch``: nothing will join
        the running requests (an offline ``generate`` whose queue is empty), so the plan values
        the batch's completion."""
        if not self.adaptive:
            return self.max_k
        if req is running[0] or not self._plan:
            self._replan(running, closed_batch)
        return self._plan.get(req.request_id, 0)

    def remaining_budget(self, req: Request) -> int:
        """Tokens ``req`` may still generate: max_tokens, and the context limit."""
        left = req.max_tokens - req.num_output_tokens
        if self.max_model_len is not None:
            left = min(left, self.max_model_len - req.num_tokens)
        return left

    def _replan(self, running: list[Request], closed_batch: bool = False) -> None:
        from specdec.spec.adaptive import choose_num_spec_tokens, completion_weights

        reqs, others, prefilling = [], 0, False
        for r in running:  # one pass: this runs every step
            decoding = r.is_decoding
            if decoding and r.sampling_params.use_speculation:
                reqs.append(r)
            else:  # rows of the same pass that never draft: prefill chunks, decode rows that opted out
                others += r.num_tokens - r.num_computed_tokens
                prefilling = prefilling or not decoding
        ids = [r.request_id for r in reqs]
        if ids and ids != self._last_ids:  # (a list compare: the batch rarely changes)
            new = len(set(ids).difference(self._last_ids))
            self._last_ids = ids
            self.guard.requests_changed(len(ids), new / len(ids))
        if not reqs or (not prefilling and not self.guard.allow(len(reqs))):
            ks = [0] * len(reqs)  # nothing to draft, or speculating steps have been slower lately
        elif not prefilling and ids == self._idle_ids and self._idle_age < self._idle_limit:
            # the last plan drafted nothing for these same requests and no acceptance has been
            # observed since: the next few would say the same (a plan costs ~0.1-0.5 ms per step)
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
            ks = choose_num_spec_tokens(alphas, self.max_k, self.cost, num_other_tokens=others,
                                        draft_per_token=self.draft_is_model, weights=weights)
            if not any(ks) and not prefilling:
                # the same requests, no acceptance seen, and again nothing to draft: the costs alone
                # drift too slowly to change that, so look less often (a plan is ~0.5 ms at batch 32)
                again = ids == self._idle_ids
                self._idle_limit = min(2 * self._idle_limit, self.replan_idle_max) if again else self.replan_idle_every
                self._idle_ids, self._idle_age = ids, 0
            else:
                self._idle_ids, self._idle_age = None, 0
        self._plan = dict(zip(ids, ks))

    def observe_acceptance(self, req: Request, num_drafted: int, num_accepted: int) -> None:
        if self.acceptance is not None:
            self.acceptance.update(req.request_id, num_drafted, num_accepted)
            self._idle_ids, self._idle_limit = None, self.replan_idle_every

    def observe_step(self, sched, proposal, t_draft: float, t_target: float) -> None:
        if self.cost is None:
            return
        self._plan = {}
        drafted = proposal.num_draft_tokens
        num_drafting = sum(1 for n in drafted if n)
        # the rows the target really ran: a proposer may fill fewer draft slots than were reserved
        # (suffix / n-gram with no match), and pricing the reserved count taught the model that
        # 128 rows cost what 45 did (batch 32, K = 3 planned, ~13 drafts found), so it planned 128
        num_rows = sum(sched.num_scheduled_tokens) + sum(drafted)
        if not num_drafting and num_rows == len(sched.requests):
            # plain decode steps repeat one shape: a sample of them keeps that knot current (its EMA
            # moves 5% per observation); observing each cost ~0.25 ms of a 35 ms batch-32 step
            self._num_plain_steps += 1
            if self._num_plain_steps % self.observe_plain_every:
                return
        self.cost.observe("target", num_rows, t_target)
        if num_drafting and self.draft_is_model:
            steps = max(proposal.num_positions)  # draft passes: K, or a tree's depth
            self.cost.observe("draft", num_drafting, t_draft / steps)

    def choose_tree_nodes(self, gains: list[list[float]], draft_seconds: float) -> list[int]:
        """Per request, how many of its tree's nodes to verify (``gains[i]``: the draft's
        probability of each node's path, best first), by the measured step costs."""
        from specdec.spec.adaptive import choose_num_tree_nodes

        scaled = [[g * self.tree_calibration for g in gs] for gs in gains]
        return choose_num_tree_nodes(scaled, self._base_rows, self.cost, draft_seconds)

    def observe_outcome(self, sched, proposal, num_emitted: int, seconds: float) -> None:
        """A whole step's tokens and wall time, for the throughput guard (pure decode/verify steps only)."""
        if self.guard is None or any(n != 1 for n in sched.num_scheduled_tokens):
            return
        if proposal.expected_accepted:  # adaptive trees: how well the draft's probabilities predict acceptance
            ratio = (num_emitted - len(sched.requests)) / proposal.expected_accepted
            self.tree_calibration = min(2.0, max(0.5, 0.95 * self.tree_calibration + 0.05 * ratio))
        # in realised tokens/s whatever the plan's weights: the guard is the check on reality
        self.guard.observe(len(sched.requests), any(proposal.draft_token_ids), num_emitted, seconds)

    def forget(self, req: Request) -> None:
        if self.acceptance is not None:
            self.acceptance.forget(req.request_id)
