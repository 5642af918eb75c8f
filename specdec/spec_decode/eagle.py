"""EAGLE proposer: the draft-model loop, fed the target's hidden states (``models/eagle.py``).

Head row p reads (f_p, token p + 1). After each target step the worker hands over the hidden
states of the rows the target kept (``observe_target``); a proposal's first pass catches the
head up on those real features (positions [head_computed, num_computed_tokens)), its last row
predicting f at the newest token's position and so draft 1; pass s feeds (predicted f, draft s)
at position num_computed_tokens + s - 1. Positions at and past num_computed_tokens hold
predicted-feature KV afterwards, so ``num_draft_computed_tokens`` is set to num_computed_tokens
and the next catch-up overwrites them with real features. Losslessness does not depend on any
of this: the drafts go through the same rejection sampler as any other.
"""
from __future__ import annotations

import torch

from specdec.spec_decode.draft_model import DraftModelProposer
from specdec.worker.request_state import CachedRequestState


class EagleProposer(DraftModelProposer):
    name = "eagle"
    needs_target_hidden = True
    row_shift = -1  # head row p holds (f_p, token p + 1): draft s sits at num_computed_tokens + s - 1

    def __init__(self, runner, target_vocab_size: int, **tree):
        super().__init__(runner, target_vocab_size, **tree)
        self.features: dict[str, tuple[int, list[torch.Tensor]]] = {}  # request -> (first position, rows)

    # ---- features from the target ----
    def observe_target(self, requests: list[CachedRequestState], starts: list[int], offsets: list[int],
                       num_kept: list[int], hidden: torch.Tensor) -> None:
        """Store the kept rows' features per request; rows past what the target kept are dropped."""
        if hidden is None:
            raise RuntimeError("the EAGLE proposer needs the target's hidden states (run the target eagerly)")
        hidden = self._target_features(hidden)
        for req, start, off, kept in zip(requests, starts, offsets, num_kept):
            if not req.sampling_params.use_speculation:
                continue
            if kept <= 0:
                continue
            rows = hidden[off:off + kept].clone()
            first, chunks = self.features.get(req.request_id, (start, []))
            end = first + sum(len(c) for c in chunks)
            if chunks and end == start:
                chunks.append(rows)
            else:  # first rows, or a recomputation after preemption: start over from here
                first, chunks = start, [rows]
                req.num_draft_computed_tokens = min(req.num_draft_computed_tokens, start)
            self.features[req.request_id] = (first, chunks)

    def _target_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the head's rows read from the target's exported rows (EAGLE: the final hidden states as they are)."""
        return hidden

    def on_request_finished(self, request: CachedRequestState) -> None:
        self.features.pop(request.request_id, None)

    def reset_history(self) -> None:
        self.features.clear()

    # ---- the passes ----
    def _first_batch(self, reqs: list[CachedRequestState], block_tables):
        feeds, starts, feats = [], [], []
        for r in reqs:
            c = r.num_computed_tokens
            first, chunks = self.features.pop(r.request_id, (c, []))
            # positions before ``first`` were never fed here in this life of the request: their head
            # KV came with prefix-cached blocks (written by whichever request computed them)
            hc = max(min(r.num_draft_computed_tokens, c), first)
            stored = torch.cat(chunks) if chunks else None
            if stored is None or hc >= c or first + len(stored) < c:
                # nothing new to read (cannot happen in the engine's step order): draft from the
                # newest token with an empty feature; the drafts are only worse, never wrong
                feeds.append([r.all_token_ids[c]])
                starts.append(c - 1)
                feats.append(torch.zeros(1, self._hidden_size(), dtype=self.runner.dtype, device=self.runner.device))
                continue
            feeds.append(r.all_token_ids[hc + 1:c + 1])
            starts.append(hc)
            feats.append(stored[hc - first:c - first])
        batch = self.runner.prepare(feeds, starts, block_tables, [[len(f) - 1] for f in feeds])
        batch.features = torch.cat(feats).to(self.runner.dtype)
        return batch

    def _next_batch(self, reqs, rows, prev_rows, tokens, step: int, block_tables, predicted=None):
        if len(rows) != len(prev_rows):  # rows only ever drop out, so they stay in order
            slot = {j: i for i, j in enumerate(prev_rows)}
            predicted = predicted.index_select(0, torch.tensor([slot[j] for j in rows], device=predicted.device))
        batch = super()._next_batch(reqs, rows, prev_rows, tokens, step, block_tables)
        batch.features = predicted
        return batch

    def _pass_hidden(self, batch, hidden: torch.Tensor | None) -> torch.Tensor:
        return hidden[batch.logits_indices]  # [rows, H] the features each drafting row predicts

    def _tree_features(self, batch, hidden: torch.Tensor, rows: list[int]) -> None:
        batch.features = hidden.index_select(0, torch.tensor(rows, device=hidden.device))

    def _finish(self, reqs: list[CachedRequestState], ks: list[int]) -> None:
        for r in reqs:
            r.num_draft_computed_tokens = r.num_computed_tokens

    def _hidden_size(self) -> int:
        return self.runner.model.config.hidden_size
