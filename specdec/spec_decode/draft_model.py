"""Draft-model proposer: a small model with its own paged KV cache drafts K tokens per request.

The draft cache has as many blocks as the target's and uses the same block ids, so the
target's block table addresses both; a draft with sliding-window layers keeps them in the KV
cache group of their window (``engine/kv_layout.py``), addressed by that group's block tables.
A proposal runs right after a step's verification.
``state.num_draft_computed_tokens`` counts the tokens whose draft KV is valid; it is clipped
to the target's ``num_computed_tokens`` (positions past it held rejected drafts), and the
first pass catches up on whatever the draft has not seen (accepted and bonus tokens, a
prompt, or everything after a preemption) in one ragged forward.

With ``tree_topk`` > 1 the proposal is a token tree (``specdec.spec_decode.tree``), grown as in
EAGLE-2: the first pass's top-k tokens are the root's children; each further pass feeds the
``tree_topk`` nodes of the newest depth with the highest path score (the sum of the draft's
log-probabilities along the path), all requests in one forward, each node attending to the
draft KV of its ancestors; after ``tree_depth`` depths the ``tree_nodes`` highest-scoring
nodes go to verification (a path's score never rises, so they are closed under ancestors).
Tree nodes are fed at the positions of their depth but written to their own slots after the
request's tokens; the draft KV there is scratch, recomputed by the next catch-up.
"""
from __future__ import annotations

import math
import time

import torch

from specdec.layers.sampler import SamplingMetadata, processed_probs, sample_from_probs
from specdec.spec_decode.growing_tree import GrowingTree
from specdec.spec_decode.plan import TreeBudget
from specdec.spec_decode.proposer import DraftProposal, Proposer, TargetStates
from specdec.worker.model_runner import ModelRunner
from specdec.worker.request_state import CachedRequestState


class DraftModelProposer(Proposer):
    name = "draft_model"
    row_shift = 0  # draft s is fed at position num_tokens + s - 1 + row_shift (EAGLE: one earlier)

    def __init__(self, runner: ModelRunner, target_vocab_size: int,
                 tree_topk: int = 1, tree_depth: int = 0, tree_nodes: int = 0, draft_vocab: torch.Tensor | None = None,
                 confidence_threshold: float = 0.0):
        self.runner = runner
        self.vocab_size = target_vocab_size
        # [n] target ids of the draft's logit columns when its LM head keeps only those (draft_vocab.py)
        self.draft_vocab = None if draft_vocab is None else draft_vocab.to(runner.device)
        # with ascending ids, a greedy chain reads its argmax and confidence on the n columns and maps
        # the token through ``draft_vocab``: the same token (ties go to the lowest id either way)
        # without a [N, target vocab] tensor per pass; sampling and grammar masks read the full width
        self.narrow_greedy = draft_vocab is not None and bool((draft_vocab[1:] > draft_vocab[:-1]).all())
        self.tree_topk = tree_topk
        self.tree_depth = tree_depth
        self.tree_nodes = tree_nodes
        # a chain stops drafting a request once the draft's top-1 probability falls below this
        # (0: always K); see ``_confident``
        self.confidence_threshold = confidence_threshold

    def _forward(self, batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits [N, target vocab], the pass's hidden states [T, H]: read by EAGLE's next pass only)."""
        logits, hidden = self._forward_columns(batch)
        return self._widen(logits), hidden

    def _forward_columns(self, batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As ``_forward``, with the logits over the draft's own columns [N, n] (``draft_vocab``)."""
        return self.runner.forward_with_hidden(batch, need_hidden=self.needs_target_hidden)

    def _widen(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits [N, its columns] over the target's vocabulary [N, target vocab]."""
        if self.draft_vocab is not None:  # -inf outside the draft vocabulary: never drafted, q = 0 there
            full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
            return full.index_copy_(1, self.draft_vocab, logits)
        v = logits.shape[-1]
        if v > self.vocab_size:  # draft vocab padded beyond the target's
            return logits[:, : self.vocab_size]
        if v < self.vocab_size:
            pad = logits.new_full((logits.shape[0], self.vocab_size - v), float("-inf"))
            return torch.cat([logits, pad], dim=1)
        return logits

    def propose(self, requests: list[CachedRequestState], num_spec: list[int],
                tree_budget: TreeBudget | None = None, grammar=None, target: TargetStates | None = None
                ) -> DraftProposal:
        active = [i for i, k in enumerate(num_spec) if k > 0]
        drafts: list[list[int]] = [[] for _ in requests]
        if not active:
            return DraftProposal(drafts, None)
        reqs = [requests[i] for i in active]
        ks = [num_spec[i] for i in active]
        if self.tree_topk > 1:
            return self._propose_tree(requests, active, ks, tree_budget, grammar)
        greedy = [r.sampling_params.is_greedy for r in reqs]
        # all greedy: every pass takes the argmax, no q (no sampling tensors to build)
        meta = None if all(greedy) else SamplingMetadata.from_params(
            [r.sampling_params for r in reqs], [r.generator for r in reqs], self.runner.device
        )
        block_tables = self._block_tables(reqs)
        batch = self._first_batch(reqs, block_tables)
        first_pass_rows = len(batch.input_ids)
        probs_per_pass, tokens_per_pass = [], []
        cursors = grammar.draft_cursors(reqs) if grammar is not None else [None] * len(reqs)
        constrained = any(c is not None for c in cursors)
        rows = list(range(len(reqs)))  # which requests are still drafting
        predicted = None  # [len(rows), H] hidden states of the last pass's drafting rows
        for step in range(max(ks)):
            if step > 0:
                prev_rows, rows = rows, [j for j in rows if ks[j] > step]
                if not rows:
                    break
                batch = self._next_batch(reqs, rows, prev_rows, [tokens_per_pass[-1][j] for j in rows], step,
                                         block_tables, predicted)
            sub = meta if meta is None or len(rows) == len(reqs) else \
                meta.expand([int(j in rows) for j in range(len(reqs))])
            narrow = self.narrow_greedy and not constrained and (sub is None or sub.all_greedy)
            logits, hidden = self._forward_columns(batch)
            if not narrow:
                logits = self._widen(logits)  # [len(rows), V]
            predicted = self._pass_hidden(batch, hidden)
            if constrained:
                grammar.mask_draft_rows(logits, [cursors[j] for j in rows], [greedy[j] for j in rows])
            if narrow:  # the draft's columns [len(rows), n]
                q, tok = None, self.draft_vocab[logits.argmax(dim=-1)]
            elif sub is None or sub.all_greedy:
                q, tok = None, logits.argmax(dim=-1)
            else:
                q = processed_probs(logits, sub)
                tok = sample_from_probs(q, sub)
                if not sub.all_random:  # greedy rows: argmax of the raw logits, q unused
                    greedy = sub.temperature == 0
                    tok = torch.where(greedy, logits.argmax(dim=-1), tok)
            tok_list = tok.tolist()
            if self.confidence_threshold > 0.0 and step + 1 < max(ks):
                for j, sure in zip(rows, self._confident(logits)):
                    if not sure:
                        ks[j] = step + 1
            full = [0] * len(reqs)
            for j, t in zip(rows, tok_list):
                full[j] = t
                drafts[active[j]].append(t)
            tokens_per_pass.append(full)
            probs_per_pass.append((rows, q))
            if constrained and step + 1 < max(ks):
                grammar.advance([cursors[j] for j in rows], tok_list)
        self._finish(reqs, ks)
        return DraftProposal(drafts, self._flat_probs(probs_per_pass, ks, active, len(requests), meta),
                             num_first_pass_rows=first_pass_rows)

    def _confident(self, logits: torch.Tensor) -> list[bool]:
        """Per row of logits [N, V]: whether the draft's top-1 probability (temperature 1) reaches
        ``confidence_threshold``. A draft unsure of its token is likely rejected there, and every
        draft after a rejection is verified for nothing. Lossless whatever it decides: at each
        position the target either verifies a draft token drawn from q or samples from p itself,
        and both emit p."""
        lp = logits.float()
        top = lp.max(dim=-1).values - torch.logsumexp(lp, dim=-1)
        return (top >= math.log(self.confidence_threshold)).tolist()

    # ---- token trees ----
    def _propose_tree(self, requests: list[CachedRequestState], active: list[int], slots: list[int],
                      tree_budget: TreeBudget | None, grammar=None) -> DraftProposal:
        """Per active request a tree of at most ``tree_nodes`` (and ``slots``) nodes, depth at most
        ``tree_depth`` and the tokens the request may still emit."""
        started = time.perf_counter()
        reqs = [requests[i] for i in active]
        block_tables = self._block_tables(reqs)
        topk = self.tree_topk
        batch = self._first_batch(reqs, block_tables)
        first_pass_rows = len(batch.input_ids)
        logits, hidden = self._forward(batch)
        hidden = self._pass_hidden(batch, hidden)
        # per request: node tokens, parents, depths, scores; the node fed at each draft slot
        trees = [GrowingTree() for _ in reqs]
        bases = [r.num_tokens + self.row_shift for r in reqs]  # position (and first slot) of depth-1 nodes
        room = [r.num_tokens + s - b for r, s, b in zip(reqs, slots, bases)]  # draft slots from base on
        # slots <= the tokens the request may still emit (the scheduler's cap), so depth is too
        depth_cap = [max(1, min(r.spec_depth or self.tree_depth, self.tree_depth, s)) for r, s in zip(reqs, slots)]
        max_depth = max(depth_cap)
        parent_rows = [(j, -1) for j in range(len(reqs))]  # (request, node) behind each row of the last pass
        constrained = grammar is not None and any(r.grammar is not None for r in reqs)
        if constrained:  # one cursor per node, forked from its parent's (-1: the root's)
            for t, cur in zip(trees, grammar.draft_cursors(reqs)):
                t.cursors[-1] = cur
        for depth in range(1, max_depth + 1):
            if constrained:
                grammar.mask_draft_rows(logits, [trees[j].cursor(n, grammar) for j, n in parent_rows])
            top_lp, top_tok = torch.log_softmax(logits.float(), dim=-1).topk(topk, dim=-1)
            for (j, node), lps, toks in zip(parent_rows, top_lp.tolist(), top_tok.tolist()):
                trees[j].add_children(node, toks, lps, depth)
            if depth == max_depth:
                break
            feeds, starts, positions, masks, tables, rows, parent_rows = [], [], [], [], [], [], []
            group_tables = []
            for j, t in enumerate(trees):
                if depth >= depth_cap[j]:
                    continue
                frontier = t.frontier(depth, min(topk, room[j] - t.num_fed))
                if not frontier:
                    continue
                start = t.num_fed
                t.feed(frontier)
                feeds.append([t.tokens[n] for n in frontier])
                starts.append(bases[j] + start)
                positions.append([bases[j] + depth - 1] * len(frontier))
                masks.append((bases[j], t.fed_mask(frontier)))
                tables.append(block_tables[j])
                group_tables.append(reqs[j].group_block_ids)
                rows.extend(t.row_of[t.parents[n]] if t.parents[n] >= 0 else j for n in frontier)
                parent_rows.extend((j, n) for n in frontier)
            if not feeds:
                break
            batch = self.runner.prepare(feeds, starts, tables, [list(range(len(f))) for f in feeds], positions, masks,
                                        group_block_tables=group_tables if self.runner.num_kv_groups > 1 else None)
            self._tree_features(batch, hidden, rows)
            logits, hidden = self._forward(batch)
            hidden = self._pass_hidden(batch, hidden)
            for row, (j, n) in enumerate(parent_rows):
                trees[j].row_of[n] = row
        self._finish_tree(reqs)
        limits = [min(self.tree_nodes, s) for s in slots]
        expected = None
        if tree_budget is not None:
            gains = [t.gains(limit) for t, limit in zip(trees, limits)]
            limits = tree_budget.choose_num_nodes(gains, time.perf_counter() - started)
            expected = [0.0] * len(requests)
            for i, g, n in zip(active, gains, limits):
                expected[i] = sum(g[:n])
        drafts: list[list[int]] = [[] for _ in requests]
        parents: list[list[int]] = [[] for _ in requests]
        for i, t, limit in zip(active, trees, limits):
            drafts[i], parents[i] = t.select(limit)
        return DraftProposal(drafts, None, parents, None if expected is None else sum(expected), first_pass_rows,
                             expected)

    def _pass_hidden(self, batch, hidden: torch.Tensor | None) -> torch.Tensor | None:
        """What the next pass needs from this one's drafting rows (EAGLE: predicted features)."""
        return None

    def _tree_features(self, batch, hidden: torch.Tensor | None, rows: list[int]) -> None:
        """Attach to a tree pass whatever its nodes read from their parents' rows of the last pass."""

    def _finish_tree(self, reqs: list[CachedRequestState]) -> None:
        for r in reqs:  # the first pass caught up on every real token; past them the draft KV is scratch
            r.num_draft_computed_tokens = r.num_tokens + self.row_shift

    # ---- the passes (the EAGLE proposer overrides these) ----
    def _block_tables(self, reqs: list[CachedRequestState]) -> list[list[int]]:
        """Each request's draft blocks: the target's (the caches share block ids)."""
        return [r.block_ids for r in reqs]

    def _group_tables(self, reqs: list[CachedRequestState]) -> list[tuple[list[int], ...]] | None:
        """Each request's blocks in the draft's other KV cache groups (None: the draft has one)."""
        return [r.group_block_ids for r in reqs] if self.runner.num_kv_groups > 1 else None

    def _first_batch(self, reqs: list[CachedRequestState], block_tables):
        """Catch up on unseen tokens; the last row drafts the first token."""
        starts = [min(r.num_draft_computed_tokens, r.num_computed_tokens) for r in reqs]
        feeds = [r.all_token_ids[s:] for r, s in zip(reqs, starts)]
        return self.runner.prepare(feeds, starts, block_tables, [[len(f) - 1] for f in feeds],
                                   group_block_tables=self._group_tables(reqs))

    def _next_batch(self, reqs, rows, prev_rows, tokens, step: int, block_tables, predicted=None):
        """Feed draft ``step`` (at position num_tokens + step - 1 + row_shift) for the requests in
        ``rows`` (``prev_rows`` drafted in the last pass; ``predicted``: that pass's ``_pass_hidden``)."""
        return self.runner.prepare([[t] for t in tokens], [reqs[j].num_tokens + step - 1 + self.row_shift for j in rows],
                                   [block_tables[j] for j in rows], [[0]] * len(rows),
                                   group_block_tables=self._group_tables([reqs[j] for j in rows]))

    def _finish(self, reqs: list[CachedRequestState], ks: list[int]) -> None:
        for r, k in zip(reqs, ks):
            # draft KV now covers the real tokens and drafts d1..d_{k-1}
            r.num_draft_computed_tokens = r.num_tokens + k - 1

    def _flat_probs(self, probs_per_pass, ks, active, num_requests, meta) -> torch.Tensor | None:
        """Reorder per-pass q rows into the flat request-major order the verifier expects."""
        if meta is None or meta.all_greedy:
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
