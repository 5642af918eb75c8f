"""Draft-model proposer: a small model with its own paged KV cache drafts K tokens per request.

The draft cache has as many blocks as the target's and uses the same block ids, so the
target's block table addresses both. ``request.num_draft_computed_tokens`` counts the
tokens whose draft KV is valid; after verification it is clipped to the target's
``num_computed_tokens`` (positions past it held rejected drafts), and the first pass of the
next proposal catches up on whatever the draft has not seen (accepted and bonus tokens,
a prompt, or everything after a preemption) in one ragged forward.
"""
from __future__ import annotations

import torch

from specdec.engine.kv_cache_manager import KVCacheManager
from specdec.engine.request import Request
from specdec.layers.sampler import SamplingMetadata, processed_probs, sample_from_probs
from specdec.runtime.model_runner import ModelRunner
from specdec.spec.proposer import DraftProposal, Proposer


class DraftModelProposer(Proposer):
    name = "draft_model"
    has_draft_model = True
    row_shift = 0  # draft s is fed at position num_tokens + s - 1 + row_shift (EAGLE: one earlier)

    def __init__(self, runner: ModelRunner, kv: KVCacheManager, target_vocab_size: int):
        self.runner = runner
        self.kv = kv
        self.vocab_size = target_vocab_size

    def _logits(self, batch) -> torch.Tensor:  # [N, target vocab]
        logits = self.runner.forward(batch)
        v = logits.shape[-1]
        if v > self.vocab_size:  # draft vocab padded beyond the target's
            return logits[:, : self.vocab_size]
        if v < self.vocab_size:
            pad = logits.new_full((logits.shape[0], self.vocab_size - v), float("-inf"))
            return torch.cat([logits, pad], dim=1)
        return logits

    def propose(self, requests: list[Request], num_spec: list[int]) -> DraftProposal:
        active = [i for i, k in enumerate(num_spec) if k > 0]
        drafts: list[list[int]] = [[] for _ in requests]
        if not active:
            return DraftProposal(drafts, None)
        reqs = [requests[i] for i in active]
        ks = [num_spec[i] for i in active]
        meta = SamplingMetadata.from_params(
            [r.sampling_params for r in reqs], [r.generator for r in reqs], self.runner.device
        )
        block_tables = [self.kv.get_block_ids(r.request_id) for r in reqs]
        batch = self._first_batch(reqs, block_tables)
        probs_per_pass, tokens_per_pass = [], []
        rows = list(range(len(reqs)))  # which requests are still drafting
        for step in range(max(ks)):
            if step > 0:
                prev_rows, rows = rows, [j for j in rows if ks[j] > step]
                batch = self._next_batch(reqs, rows, prev_rows, [tokens_per_pass[-1][j] for j in rows], step,
                                         block_tables)
            logits = self._logits(batch)  # [len(rows), V]
            sub = meta if len(rows) == len(reqs) else meta.expand([int(j in rows) for j in range(len(reqs))])
            if sub.all_greedy:
                q, tok = None, logits.argmax(dim=-1)
            else:
                q = processed_probs(logits, sub)
                tok = sample_from_probs(q, sub)
                if not sub.all_random:  # greedy rows: argmax of the raw logits, q unused
                    greedy = sub.temperature == 0
                    tok = torch.where(greedy, logits.argmax(dim=-1), tok)
            tok_list = tok.tolist()
            full = [0] * len(reqs)
            for j, t in zip(rows, tok_list):
                full[j] = t
                drafts[active[j]].append(t)
            tokens_per_pass.append(full)
            probs_per_pass.append((rows, q))
        self._finish(reqs, ks)
        return DraftProposal(drafts, self._flat_probs(probs_per_pass, ks, active, len(requests), meta))

    # ---- the passes (the EAGLE proposer overrides these three) ----
    def _first_batch(self, reqs: list[Request], block_tables):
        """Catch up on unseen tokens; the last row drafts the first token."""
        starts = [min(r.num_draft_computed_tokens, r.num_computed_tokens) for r in reqs]
        feeds = [r.all_token_ids[s:] for r, s in zip(reqs, starts)]
        return self.runner.prepare(feeds, starts, block_tables, [[len(f) - 1] for f in feeds])

    def _next_batch(self, reqs, rows, prev_rows, tokens, step: int, block_tables):
        """Feed draft ``step`` (at position num_tokens + step - 1 + row_shift) for the requests in ``rows``."""
        return self.runner.prepare([[t] for t in tokens], [reqs[j].num_tokens + step - 1 + self.row_shift for j in rows],
                                   [block_tables[j] for j in rows], [[0]] * len(rows))

    def _finish(self, reqs: list[Request], ks: list[int]) -> None:
        for r, k in zip(reqs, ks):
            # draft KV now covers the real tokens and drafts d1..d_{k-1}
            r.num_draft_computed_tokens = r.num_tokens + k - 1

    def _flat_probs(self, probs_per_pass, ks, active, num_requests, meta) -> torch.Tensor | None:
        """Reorder per-pass q rows into the flat request-major order the verifier expects."""
        if meta.all_greedy:
            return None
        total = sum(ks)
        out = torch.zeros(total, self.vocab_size, dtype=torch.float32, device=self.runner.device)
        offsets, acc = [], 0
        for k in ks:
            offsets.append(acc)
            acc += k
        for step, (rows, q) in enumerate(probs_per_pass):
            if q is None:
                continue
            idx = torch.tensor([offsets[j] + step for j in rows], device=out.device)
            out.index_copy_(0, idx, q)
        return out
