"""A draft model with another tokenizer than its target, drafting through the token-level
vocabulary intersection ``I`` of a ``VocabBridge``.

The draft reads each request's text tokenized its own way: the target tokens' bytes, re-encoded
by the draft tokenizer as tokens arrive (``DraftContext``). When it drafts, its LM head keeps only
the rows of ``I``'s draft tokens (``draft_vocab.restrict_lm_head``), so the distribution it samples
from is its next-token distribution restricted to ``I`` and renormalised,
``q(t) = p_draft(d(t)) / sum_{u in I} p_draft(u)`` for target tokens t in I and 0 elsewhere, after
the request's temperature / top-k / top-p and grammar mask, exactly as for a same-vocabulary draft.
The sampled draft token maps to its target id and the next pass feeds that draft token.

Why it is lossless: the rejection sampler keeps the target's distribution for any proposal
distribution q, as long as each draft token is drawn from the q it is given (Leviathan et al.,
Theorem 1: accept x ~ q with probability min(1, p(x) / q(x)), else draw from
normalise(max(0, p - q))). Here q is over the target vocabulary (0 outside I) and the token is
drawn from exactly that q; what the draft saw before (any tokenization of any context) only
changes q, never the output distribution. Greedy: the draft token is the argmax over I, and the
verifier emits the target's argmax whatever the draft proposed.

The draft's KV cache is its own: a draft tokenization has its own length, so this proposer hands
out the draft cache's blocks itself (as many as the target's); a request the pool or the draft's
position limit cannot serve gets no drafts that step. After each verification the committed
tokens are re-encoded from a few draft tokens back; the draft KV stays valid for the longest
common prefix of what it holds (the old tokenization and the drafts it fed) and the new
tokenization, so an accepted draft is recomputed only where the draft tokenizer merges it with its
neighbours differently. Token trees are refused (``methods.py``).
"""
from __future__ import annotations

from itertools import accumulate

from specdec.spec_decode.draft_model import DraftModelProposer
from specdec.spec_decode.plan import TreeBudget
from specdec.spec_decode.proposer import DraftProposal, TargetStates
from specdec.spec_decode.vocab_bridge import VocabBridge
from specdec.worker.model_runner import ModelRunner
from specdec.worker.request_state import CachedRequestState

RETOKENIZE_TAIL = 4  # draft tokens re-encoded behind the newest text: a merge rarely reaches further back


class DraftContext:
    """One request's text as the draft sees it, and the draft cache it holds."""

    def __init__(self):
        self.num_target_tokens = 0  # target tokens whose bytes are in ``text``
        self.text = bytearray()
        self.ids: list[int] = []  # the draft tokenization of the text's complete UTF-8 prefix
        # byte offset where each of ``ids`` ends; None when the tokens' bytes do not spell the text
        # (a tokenizer that inserts a prefix space, unknown tokens): then every sync re-encodes it all
        self.ends: list[int] | None = []
        self.kv_ids: list[int] = []  # draft tokens whose KV is in the cache, positions 0, 1, ...
        self.blocks: list[int] = []

    def sync(self, bridge: VocabBridge, target_ids: list[int]) -> None:
        """Take in the target tokens after ``num_target_tokens`` and re-encode the tail."""
        if len(target_ids) == self.num_target_tokens:
            return
        for t in target_ids[self.num_target_tokens:]:
            self.text += bridge.target_bytes[t]
        self.num_target_tokens = len(target_ids)
        keep = 0 if self.ends is None else max(0, len(self.ids) - RETOKENIZE_TAIL)
        start = self.ends[keep - 1] if keep else 0
        new, stop = bridge.encode_bytes(bytes(self.text[start:]))
        self.ids = self.ids[:keep] + new
        lengths = [len(bridge.draft_bytes[d]) for d in new]
        self.ends = (self.ends[:keep] + list(accumulate(lengths, initial=start))[1:]
                     if self.ends is not None and sum(lengths) == stop else None)

    def num_valid_kv(self) -> int:
        """Draft tokens at the start of ``ids`` whose KV the cache holds."""
        n = 0
        for a, b in zip(self.kv_ids, self.ids):
            if a != b:
                break
            n += 1
        return n


class CrossTokenizerProposer(DraftModelProposer):
    name = "draft_model"

    def __init__(self, runner: ModelRunner, target_vocab_size: int, bridge: VocabBridge, max_positions: int,
                 confidence_threshold: float = 0.0):
        super().__init__(runner, target_vocab_size, draft_vocab=bridge.target_ids,
                         confidence_threshold=confidence_threshold)
        self.bridge = bridge
        self.max_positions = max_positions  # the draft model's position limit
        self.contexts: dict[str, DraftContext] = {}
        self.free_blocks = list(range(runner.num_blocks - 1, 0, -1))  # block 0 stays unused, as the target's

    def propose(self, requests: list[CachedRequestState], num_spec: list[int],
                tree_budget: TreeBudget | None = None, grammar=None, target: TargetStates | None = None
                ) -> DraftProposal:
        num_spec = [k if k > 0 and self._prepare(r, k) else 0 for r, k in zip(requests, num_spec)]
        return super().propose(requests, num_spec, tree_budget, grammar, target)

    def _prepare(self, request: CachedRequestState, k: int) -> bool:
        """Bring the request's draft context up to its committed tokens and hold the draft blocks k
        drafts need; False if it cannot draft now."""
        ctx = self.contexts.setdefault(request.request_id, DraftContext())
        ctx.sync(self.bridge, request.all_token_ids)
        if not ctx.ids:
            return False
        ctx.kv_ids = ctx.kv_ids[:min(ctx.num_valid_kv(), len(ctx.ids) - 1)]  # >= 1 token fed: it drafts
        need = len(ctx.ids) + k - 1  # positions written: the tokens and drafts 1..k-1
        if need > self.max_positions:
            return False
        missing = -(-need // self.runner.block_size) - len(ctx.blocks)
        if missing > len(self.free_blocks):
            return False
        ctx.blocks.extend(self.free_blocks.pop() for _ in range(max(0, missing)))
        return True

    def _block_tables(self, reqs: list[CachedRequestState]) -> list[list[int]]:
        return [self.contexts[r.request_id].blocks for r in reqs]

    def _first_batch(self, reqs: list[CachedRequestState], block_tables):
        ctxs = [self.contexts[r.request_id] for r in reqs]
        feeds = [c.ids[len(c.kv_ids):] for c in ctxs]
        return self.runner.prepare(feeds, [len(c.kv_ids) for c in ctxs], block_tables, [[len(f) - 1] for f in feeds])

    def _next_batch(self, reqs, rows, prev_rows, tokens, step: int, block_tables, predicted=None):
        fed = [self.bridge.draft_token_for(t) for t in tokens]
        ctxs = [self.contexts[reqs[j].request_id] for j in rows]
        for c, d in zip(ctxs, fed):
            if len(c.kv_ids) < len(c.ids):  # the first pass wrote every token
                c.kv_ids = list(c.ids)
            c.kv_ids.append(d)
        return self.runner.prepare([[d] for d in fed], [len(c.kv_ids) - 1 for c in ctxs],
                                   [block_tables[j] for j in rows], [[0]] * len(rows))

    def _finish(self, reqs: list[CachedRequestState], ks: list[int]) -> None:
        for r in reqs:
            ctx = self.contexts[r.request_id]
            if len(ctx.kv_ids) < len(ctx.ids):  # drafted one token: only the first pass ran
                ctx.kv_ids = list(ctx.ids)

    def on_request_finished(self, request: CachedRequestState) -> None:
        ctx = self.contexts.pop(request.request_id, None)
        if ctx is not None:
            self.free_blocks.extend(reversed(ctx.blocks))
