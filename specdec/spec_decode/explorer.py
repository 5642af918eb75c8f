"""Explorer: "auto"'s rule for drafting in a step whose plan drafts nothing, so a policy at K = 0
keeps learning, within a budget of the plain decoding time it may lose."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from specdec.spec_decode.acceptance import AcceptanceEstimator
from specdec.spec_decode.cost_model import StepCostModel

if TYPE_CHECKING:
    from specdec.engine.step_record import StepRecord


class Explorer:
    """K = 1 for every decoding request, in a step whose plan drafts nothing, when drafting could
    still pay and the budget allows it.

    Why: a plan of K = 0 observes no acceptance, so a belief that drafts fail (the prior, on a
    target whose verification rows are dear, or evidence from a bad patch of text) would be its
    last word, though the text, and with it the acceptance, changes.

    "Could still pay": the plan at the pooled acceptance's optimistic bound, ``z`` posterior
    standard deviations above its mean (``AcceptanceEstimator.optimistic_position_acceptance``),
    drafts. That bound falls as rejections come in and rises again as evidence ages (the
    estimator's ``pooled_idle_decay``): a draft that keeps failing is retried ever more rarely,
    and one that starts to pay is found. K = 1 is the cheapest draft that tests the first
    position, whose acceptance bounds the gain of every deeper one.

    The budget: exploring may lose at most ``share`` of plain decoding time. Each plain step (no
    drafts verified) earns ``share`` of its seconds, saved up to ``window`` steps' worth (so the
    first explorations of an engine need not wait); an exploring step pays its predicted extra
    target rows and draft pass, less its accepted tokens at the plain step's price per token.
    At true acceptance 0 "auto" then stays within about ``share`` of plain decoding (plus one
    window's saving, once), and drafts that are accepted pay for further exploring, so a
    recovered draft is confirmed within a few steps."""

    def __init__(self, acceptance: AcceptanceEstimator, max_k: int, draft_is_model: bool,
                 share: float = 0.02, window: int = 128, z: float = 1.645):
        if not 0.0 <= share < 1.0 or window < 1 or not z >= 0.0:
            raise ValueError(f"bad Explorer settings: share={share}, window={window}, z={z}")
        self.acceptance, self.max_k, self.draft_is_model = acceptance, max_k, draft_is_model
        self.share, self.window, self.z = share, window, z
        self.credit: float | None = None  # seconds exploring may still lose; None until a plain step
        # (request ids, a plain step's seconds per request) of exploring drafts: planned in one
        # step, verified in the next (a plan's drafts are proposed at the end of its step)
        self._planned: tuple[frozenset[str], float] | None = None
        self._verifying: tuple[frozenset[str], float] | None = None

    def plan(self, ids: list[str], num_other_tokens: int, cost: StepCostModel, step_overhead: float,
             num_requests: int | None = None) -> list[int] | None:
        """K per request (all 1) if this all-zero step should explore, else None. ``num_requests``:
        the pass's requests (its batch bucket's price; None: priced by rows)."""
        if self.credit is None or not ids or self.max_k < 1:
            return None
        num = len(ids)
        base_rows = num + num_other_tokens
        if self.credit < self._extra_seconds(cost, base_rows, num, num_requests):
            return None
        from specdec.spec_decode.adaptive import choose_num_spec_tokens

        optimistic = np.repeat(self.acceptance.optimistic_position_acceptance(self.z)[None], num, axis=0)
        if not any(choose_num_spec_tokens(optimistic, self.max_k, cost, num_other_tokens=num_other_tokens,
                                          draft_per_token=self.draft_is_model, step_overhead=step_overhead,
                                          num_requests=num_requests)):
            return None
        self._planned = (frozenset(ids), (cost.cost("target", base_rows, num_requests) + step_overhead) / num)
        return [1] * num

    def observe(self, record: StepRecord, cost: StepCostModel) -> None:
        """Earn on a plain step; pay for the exploring drafts this step verified."""
        exploring, self._verifying, self._planned = self._verifying, self._planned, None
        result = record.result
        if not any(result.num_draft_tokens):
            cap = self.share * self.window * record.step_seconds
            credit = cap if self.credit is None else self.credit
            self.credit = min(cap, credit + self.share * record.step_seconds)
            return
        if exploring is None or self.credit is None:
            return
        ids, seconds_per_token = exploring
        num_drafts = num_accepted = 0
        for rid, drafted, _, accepted in record.drafts():
            if rid in ids:
                num_drafts, num_accepted = num_drafts + drafted, num_accepted + accepted
        if num_drafts:
            base_rows = sum(record.scheduled.num_scheduled_tokens) + sum(result.num_draft_tokens) - num_drafts
            self.credit -= (self._extra_seconds(cost, base_rows, num_drafts, len(record.scheduled.request_ids))
                            - num_accepted * seconds_per_token)

    def _extra_seconds(self, cost: StepCostModel, base_rows: int, num_drafts: int,
                       num_requests: int | None = None) -> float:
        """A step's seconds beyond plain decoding for ``num_drafts`` one-token drafts among ``base_rows``."""
        rows = cost.cost("target", base_rows + num_drafts, num_requests) - cost.cost("target", base_rows, num_requests)
        return rows + (cost.cost("draft", num_drafts) if self.draft_is_model else 0.0)
