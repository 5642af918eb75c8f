"""StructuredOutputStage: the worker's grammar work, one hook per place a step touches it.

Lossless under speculation:
- ``mask_draft_rows``: a draft model / EAGLE head drafts from its masked distribution, and
  that masked q is what the rejection sampler divides by, so min(1, p/q) stays exact;
- ``prune``: drafts from proposers that cannot see the grammar (n-gram, suffix) are cut at
  the first token it rejects (a token tree loses that node and its subtree) before the
  target runs;
- ``mask_verification_rows`` / ``mask_after_processors``: every target row a constrained
  request verifies gets the mask after that row's drafted prefix, so the verifier sees the
  constrained target distribution p;
- ``commit``: the decided tokens move the request's committed matcher, then the tokens the
  grammar forces (exactly one allowed) join the output without a target decision.
Every hook walks cursors forked from the committed matcher (``grammar_state.py``). The stage
keeps the seconds it spent (matchers and masks) until the worker takes them into the step's
output, so two engines in one process never mix their timings.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdec.structured_output.grammar_state import GrammarCursor, GrammarState, end_dead_ends
from specdec.structured_output.masking import apply_bitmask

if TYPE_CHECKING:
    from specdec.spec_decode.proposer import DraftProposal
    from specdec.worker.request_state import CachedRequestState

MAX_FORCED_TOKENS = 64  # per request and step


@dataclass
class VerificationMasks:
    bitmask: torch.Tensor  # [verification rows, ceil(V / 32)] int32
    full: list[int]  # constrained rows masked before the logits processors (sampled, or wanting logprobs)
    lazy: list[int]  # constrained rows of greedy requests without logprobs: only their argmax is read


class StructuredOutputStage:
    def __init__(self, compile_grammar, vocab_size: int, eos_token_ids: tuple[int, ...], forced_tokens: bool):
        self._compile = compile_grammar  # StructuredOutputsParams -> compiled grammar
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.forced_tokens = forced_tokens
        self.seconds = 0.0

    def new_grammar(self, params) -> GrammarState:
        """The request's committed grammar; a constraint meant for the answer after a reasoning
        model's thinking is gated behind it (``reasoning_grammar.py``)."""
        from specdec.structured_output.reasoning_grammar import gated_state

        with self.timed():
            return gated_state(params, GrammarState(self._compile(params), self.vocab_size, self.eos_token_ids))

    @contextmanager
    def timed(self):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - t

    def take_seconds(self) -> float:
        """Seconds spent since the last call."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    # ---- drafting ----
    def draft_cursors(self, reqs: list[CachedRequestState]) -> list[GrammarCursor | None]:
        """Per request a cursor at its committed output (None: unconstrained)."""
        with self.timed():
            return [None if r.grammar is None else r.grammar.cursor() for r in reqs]

    def advance(self, cursors: list[GrammarCursor | None], tokens: list[int]) -> None:
        with self.timed():
            for cur, t in zip(cursors, tokens):
                if cur is not None:
                    cur.advance(t)

    def child(self, cursor: GrammarCursor | None, token: int) -> GrammarCursor | None:
        """A tree node's cursor: its parent's, forked, after the node's token."""
        if cursor is None:
            return None
        with self.timed():
            cur = cursor.fork()
            cur.advance(token)
            return cur

    def mask_draft_rows(self, logits: torch.Tensor, cursors: list[GrammarCursor | None],
                        greedy: list[bool] | None = None) -> None:
        """Draft logits [len(cursors), V]: row j masked to what its cursor allows (None: left
        alone). ``greedy[j]``: row j reads only its argmax (a greedy chain; a tree reads its
        top-k, so every row is masked)."""
        rows = [j for j, c in enumerate(cursors) if c is not None]
        if not rows:
            return
        with self.timed():
            bitmask = GrammarState.allocate(len(cursors), logits.shape[1])
            for j in rows:
                cursors[j].fill(bitmask, j)
            end_dead_ends(bitmask, rows, [cursors[j] for j in rows])
            argmax_only = None if greedy is None else [greedy[j] for j in rows]
            apply_bitmask(logits, bitmask, rows, fallback_uniform=True, argmax_only=argmax_only)

    def prune(self, reqs: list[CachedRequestState], proposal: DraftProposal) -> DraftProposal:
        """Drop the drafts a constrained request's grammar rejects (a chain from its first
        rejected token on; a tree node and its subtree)."""
        if not any(r.grammar is not None and d for r, d in zip(reqs, proposal.draft_token_ids)):
            return proposal
        with self.timed():
            return prune_drafts(reqs, proposal)

    # ---- verification ----
    def mask_verification_rows(self, logits: torch.Tensor, vreqs: list[CachedRequestState],
                               histories: list[list[list[int]]]) -> VerificationMasks | None:
        """Mask now the verification rows (request-major, ``histories[k]``: request k's rows'
        drafted prefixes) of constrained requests that sample or want logprobs (the logprobs are
        then the constrained distribution's); the greedy rows wait for ``mask_after_processors``."""
        if all(r.grammar is None for r in vreqs):
            return None
        with self.timed():
            bitmask = GrammarState.allocate(sum(len(h) for h in histories), logits.shape[1])
            full, lazy, cursors, first = [], [], [], 0
            for req, paths in zip(vreqs, histories):
                if req.grammar is not None:
                    for r, cur in enumerate(req.grammar.path_cursors(paths)):
                        cur.fill(bitmask, first + r)
                        cursors.append(cur)
                    p = req.sampling_params
                    (lazy if p.is_greedy and p.logprobs is None else full).extend(range(first, first + len(paths)))
                first += len(paths)
            end_dead_ends(bitmask, sorted(full + lazy), cursors)
            apply_bitmask(logits, bitmask, full, fallback_uniform=False)
        return VerificationMasks(bitmask, full, lazy)

    def mask_after_processors(self, logits: torch.Tensor, masks: VerificationMasks | None,
                              vreqs: list[CachedRequestState]) -> None:
        """After the logits processors: greedy rows masked only if their argmax is banned, and
        every row again where min_tokens may have banned the only token the grammar allows
        (with the uniform fallback)."""
        if masks is None:
            return
        again = masks.full if any(r.sampling_params.min_tokens > r.num_output_tokens for r in vreqs) else []
        with self.timed():
            apply_bitmask(logits, masks.bitmask, again + masks.lazy, fallback_uniform=True,
                          argmax_only=[False] * len(again) + [True] * len(masks.lazy))

    # ---- commit ----
    def commit(self, req: CachedRequestState, tokens: list[int], logprobs: list | None) -> int:
        """Accept ``tokens`` (already appended to ``req``) for good, then append the tokens the
        grammar forces (probability 1 under the mask: ``logprobs`` gets 0.0 for each); returns
        how many were forced. The next step computes their KV with the newest token."""
        if req.grammar is None:
            return 0
        with self.timed():
            req.grammar.commit(tokens)
            if not self.forced_tokens:
                return 0
            scratch = GrammarState.allocate(1, req.grammar.vocab_size)
            forced = 0
            while forced < MAX_FORCED_TOKENS:
                token = req.grammar.forced_token(scratch)
                if token is None:
                    break
                req.grammar.commit([token])
                req.append_output_token(token)
                tokens.append(token)
                if logprobs is not None:
                    logprobs.append({token: 0.0})
                forced += 1
            return forced


def prune_drafts(reqs, proposal: DraftProposal) -> DraftProposal:
    """``StructuredOutputStage.prune`` without the clock (``reqs[i].grammar``: a ``GrammarState``,
    or anything with its ``path_cursors``)."""
    from specdec.spec_decode import tree

    kept: list[list[int] | None] = [None] * len(reqs)
    for i, req in enumerate(reqs):
        drafts = proposal.draft_token_ids[i]
        grammar = req.grammar
        if grammar is None or not drafts:
            continue
        if proposal.is_tree:
            parents = proposal.draft_parents[i]
            paths = [[drafts[a] for a in tree.path_to(parents, node)] for node in range(len(drafts))]
            cursors = grammar.path_cursors(paths)
            keep = [node for node, (path, cur) in enumerate(zip(paths, cursors)) if cur.num_accepted == len(path)]
        else:
            keep = list(range(grammar.path_cursors([drafts])[0].num_accepted))
        if len(keep) < len(drafts):
            kept[i] = keep
    if all(k is None for k in kept):
        return proposal
    return proposal.keep_drafts(kept)
