"""EAGLE proposer: the draft-model loop, fed the target's hidden states (``models/eagle.py``).

Head row p reads (f_p, token p + 1). A proposal runs right after the target's verification,
from that step's hidden states (``TargetStates``): nothing is kept across steps. Its first pass
catches the head up on the rows the target kept this step (positions [head_computed,
num_computed_tokens)), its last row reading the newest token and so predicting draft 1; pass s
feeds (predicted f, draft s) at position num_computed_tokens + s - 1. Requests that draft
nothing this step (K = 0, a prefill chunk) still catch up in the first pass, without logits, so
the head's KV never misses a position. Positions at and past num_computed_tokens hold
predicted-feature KV afterwards, so ``num_draft_computed_tokens`` is set to num_computed_tokens
and the next catch-up overwrites them with real features. Losslessness does not depend on any
of this: the drafts go through the same rejection sampler as any other.
"""
from __future__ import annotations

import torch

from specdec.spec_decode.draft_model import DraftModelProposer
from specdec.spec_decode.proposer import DraftProposal, TargetStates
from specdec.worker.request_state import CachedRequestState


class EagleProposer(DraftModelProposer):
    name = "eagle"
    needs_target_hidden = True
    row_shift = -1  # head row p holds (f_p, token p + 1): draft s sits at num_computed_tokens + s - 1

    def __init__(self, runner, target_vocab_size: int, **tree):
        super().__init__(runner, target_vocab_size, **tree)
        self._target: TargetStates | None = None  # during a proposal: the step's target states
        self._index: dict[str, int] = {}  # during a proposal: request id -> its index in ``_target``
        self._followers: list[CachedRequestState] = []  # during a proposal: requests that only catch up

    def propose(self, requests: list[CachedRequestState], num_spec: list[int], tree_budget=None, grammar=None,
                target: TargetStates | None = None) -> DraftProposal:
        if target is None:
            raise ValueError("the EAGLE proposer drafts from the target's hidden states of the step: pass target=")
        self._target = target
        self._index = {r.request_id: i for i, r in enumerate(requests)}
        self._followers = [r for r, k, kept in zip(requests, num_spec, target.num_kept)
                           if not k and kept > 0 and r.sampling_params.use_speculation]
        try:
            if any(num_spec):
                proposal = super().propose(requests, num_spec, tree_budget, grammar)
            else:
                proposal = DraftProposal.empty(len(requests))
                if self._followers:
                    batch = self._first_batch([], [])
                    self._forward(batch)
                    proposal.num_first_pass_rows = len(batch.input_ids)
            for r in self._followers:
                r.num_draft_computed_tokens = r.num_computed_tokens
        finally:
            self._target, self._index, self._followers = None, {}, []
        return proposal

    def _target_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the head's rows read from the target's exported rows (EAGLE: the final hidden states as they are)."""
        return hidden

    # ---- the passes ----
    def _first_batch(self, reqs: list[CachedRequestState], block_tables):
        """The drafting requests' catch-up rows (the last one of each wants logits), then the
        followers' (no logits)."""
        target = self._target
        feeds, starts, rows, logit_rows = [], [], [], []
        everyone = list(reqs) + self._followers
        for j, r in enumerate(everyone):
            i = self._index[r.request_id]
            first, offset, c = target.starts[i], target.offsets[i], r.num_computed_tokens
            # positions before ``first`` were not fed this step: their head KV is from earlier steps
            # or came with prefix-cached blocks (written by whichever request computed them)
            hc = max(min(r.num_draft_computed_tokens, c), first)
            if hc >= c:
                raise RuntimeError(f"request {r.request_id}: the target kept no rows this step to draft from")
            feeds.append(r.all_token_ids[hc + 1:c + 1])
            starts.append(hc)
            rows.extend(range(offset + hc - first, offset + c - first))
            logit_rows.append([c - hc - 1] if j < len(reqs) else [])
        tables = list(block_tables) + [r.block_ids for r in self._followers]
        batch = self.runner.prepare(feeds, starts, tables, logit_rows)
        index = torch.tensor(rows, dtype=torch.int64, device=target.hidden.device)
        batch.features = self._target_features(target.hidden.index_select(0, index)).to(self.runner.dtype)
        return batch

    def _next_batch(self, reqs, rows, prev_rows, tokens, step: int, block_tables, predicted=None):
        if len(rows) != len(prev_rows):  # rows only ever drop out, so they stay in order
            slot = {j: i for i, j in enumerate(prev_rows)}
            predicted = predicted.index_select(0, torch.tensor([slot[j] for j in rows], device=predicted.device))
        batch = super()._next_batch(reqs, rows, prev_rows, tokens, step, block_tables)
        batch.features = predicted
        return batch

    def _pass_hidden(self, batch, hidden: torch.Tensor | None) -> torch.Tensor:
        # [rows, H] the features each drafting row predicts; a pass after the first has one row
        # per drafting request, all of them wanted, so no gather
        if len(batch.logits_indices) == hidden.shape[0]:
            return hidden
        return hidden[batch.logits_indices]

    def _tree_features(self, batch, hidden: torch.Tensor, rows: list[int]) -> None:
        batch.features = hidden.index_select(0, torch.tensor(rows, device=hidden.device))

    def _finish(self, reqs: list[CachedRequestState], ks: list[int]) -> None:
        for r in reqs:
            r.num_draft_computed_tokens = r.num_computed_tokens
