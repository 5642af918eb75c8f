"""Grammar masks on logits, and drafts cut to what the grammar accepts.

Lossless under speculation (the module the worker and the draft proposers call):
- every target row a constrained request verifies gets the mask of the grammar state after
  that row's drafted prefix, so the verifier sees the constrained target distribution p;
- a draft model / EAGLE head drafts from its masked distribution, and that masked q is what
  the rejection sampler divides by, so min(1, p/q) stays exact;
- drafts from proposers that cannot see the grammar (n-gram, suffix) are cut at the first
  token it rejects (a token tree loses that node and its subtree) before the target runs.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from specdec.spec_decode import tree
from specdec.spec_decode.proposer import DraftProposal
from specdec.structured_output.grammar_state import GrammarState, end_dead_ends
from specdec.worker.request_state import CachedRequestState


class GrammarClock:
    """Seconds this process spent on grammar work (matchers, masks) since the last ``take``."""

    def __init__(self):
        self.seconds = 0.0

    @contextmanager
    def timed(self):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - t

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


GRAMMAR_CLOCK = GrammarClock()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], fallback_uniform: bool,
                  argmax_only: list[bool] | None = None) -> None:
    """Set disallowed logits of ``rows`` to -inf in place (``bitmask`` row r masks logits row r).

    ``argmax_only[j]``: only row ``rows[j]``'s argmax will be read (a greedy row without
    logprobs): it is left alone when its argmax is allowed, which is then the masked argmax
    too (ties included: the first maximum is allowed, so it is the first allowed maximum).
    A row left with no finite logit (a draft that gives every allowed token zero probability,
    or min_tokens banning the only token the grammar allows) becomes uniform over the allowed
    tokens when ``fallback_uniform``: any q is lossless as long as it is the one used."""
    if argmax_only is not None and any(argmax_only):
        rows = _rows_whose_argmax_is_banned(logits, bitmask, rows, argmax_only)
    if not rows:
        return
    if logits.device.type == "cpu":
        _apply_cpu(logits, bitmask, rows)
    else:
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
    if not fallback_uniform:
        return
    index = torch.tensor(rows, device=logits.device)
    dead = logits.index_select(0, index).amax(dim=-1) == float("-inf")
    for r in index[dead.cpu()].tolist():
        allowed = unpack_row(bitmask[r], logits.shape[1]).to(logits.device)
        with torch.inference_mode():
            logits[r] = torch.where(allowed, 0.0, float("-inf"))


def _rows_whose_argmax_is_banned(logits, bitmask, rows, argmax_only) -> list[int]:
    lazy = [r for r, only in zip(rows, argmax_only) if only]
    index = torch.tensor(lazy, dtype=torch.int64)
    if lazy == list(range(lazy[0], lazy[0] + len(lazy))):  # no copy of the rows
        top = logits[lazy[0]:lazy[0] + len(lazy)].argmax(dim=-1).cpu()
    else:
        top = logits.index_select(0, index.to(logits.device)).argmax(dim=-1).cpu()
    allowed = (bitmask[index, top // 32] >> (top % 32).to(torch.int32)) & 1
    banned = [lazy[j] for j in (allowed == 0).nonzero().flatten().tolist()]
    return [r for r, only in zip(rows, argmax_only) if not only] + banned


def _apply_cpu(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """numpy's table-driven unpackbits, then one masked fill (faster than xgrammar's CPU kernel)."""
    import numpy as np

    vocab = logits.shape[1]
    words = bitmask.numpy()[rows]
    allowed = torch.from_numpy(np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab])
    banned = allowed.view(torch.bool).logical_not_()
    first = rows[0]
    with torch.inference_mode():  # the runner's logits are inference tensors
        if rows == list(range(first, first + len(rows))):
            logits[first:first + len(rows)].masked_fill_(banned, float("-inf"))
        else:
            index = torch.tensor(rows)
            logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(banned, float("-inf")))


def unpack_row(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """One bitmask row -> [vocab_size] bool (the reference the fast paths are tested against)."""
    shifts = torch.arange(32, dtype=torch.int32)
    return ((words.unsqueeze(-1) >> shifts) & 1).view(-1)[:vocab_size].bool()


def mask_draft_logits(logits: torch.Tensor, reqs: list[CachedRequestState], paths: list[list[int]],
                      tree: bool = False) -> None:
    """Draft logits [len(reqs), V]: row j masked to what request j's grammar allows after its
    committed output + ``paths[j]`` (the tokens drafted before this row). A greedy chain
    reads only each row's argmax; a tree reads its top-k, so every row is masked."""
    rows = [j for j, r in enumerate(reqs) if r.grammar is not None]
    if not rows:
        return
    with GRAMMAR_CLOCK.timed():
        bitmask = GrammarState.allocate(len(reqs), logits.shape[1])
        for j in rows:
            grammar = reqs[j].grammar
            grammar.goto(paths[j])
            grammar.fill(bitmask, j)
        end_dead_ends(bitmask, rows, [reqs[j].grammar for j in rows])
        argmax_only = None if tree else [reqs[j].sampling_params.is_greedy for j in rows]
        apply_bitmask(logits, bitmask, rows, fallback_uniform=True, argmax_only=argmax_only)


def end_drafting(reqs: list[CachedRequestState]) -> None:
    """Put every grammar back at its committed output after a proposal."""
    with GRAMMAR_CLOCK.timed():
        for r in reqs:
            if r.grammar is not None:
                r.grammar.goto([])


def prune_proposal(reqs: list[CachedRequestState], proposal: DraftProposal) -> DraftProposal:
    """Drop the drafts a constrained request's grammar rejects (a chain from its first rejected
    token on; a tree node and its subtree)."""
    with GRAMMAR_CLOCK.timed():
        return _prune(reqs, proposal)


def _prune(reqs: list[CachedRequestState], proposal: DraftProposal) -> DraftProposal:
    kept: list[list[int] | None] = [None] * len(reqs)
    for i, req in enumerate(reqs):
        drafts = proposal.draft_token_ids[i]
        grammar = req.grammar
        if grammar is None or not drafts:
            continue
        if proposal.is_tree:
            parents = proposal.draft_parents[i]
            valid: list[bool] = []
            for node, parent in enumerate(parents):
                path = [drafts[a] for a in tree.path_to(parents, node)]
                valid.append((parent < 0 or valid[parent]) and grammar.goto(path) == len(path))
            keep = [node for node, ok in enumerate(valid) if ok]
        else:
            keep = list(range(grammar.goto(drafts)))
        grammar.goto([])
        if len(keep) < len(drafts):
            kept[i] = keep
    if all(k is None for k in kept):
        return proposal
    return proposal.keep_drafts(kept)


def verification_bitmask(reqs: list[CachedRequestState], histories: list[list[list[int]]],
                         vocab_size: int) -> tuple[torch.Tensor, list[int], list[int]] | None:
    """Masks for the target's verification rows (request-major, ``histories[k]`` = request k's
    rows): (bitmask [rows, words], the constrained rows to mask in full, the constrained rows
    of greedy requests without logprobs, whose argmax alone is read); None if none is constrained."""
    if all(r.grammar is None for r in reqs):
        return None
    bitmask = GrammarState.allocate(sum(len(h) for h in histories), vocab_size)
    full, lazy, states, first = [], [], [], 0
    for req, paths in zip(reqs, histories):
        if req.grammar is not None:
            req.grammar.path_masks(paths, bitmask, first)
            p = req.sampling_params
            (lazy if p.is_greedy and p.logprobs is None else full).extend(range(first, first + len(paths)))
            states.extend([req.grammar] * len(paths))
        first += len(paths)
    end_dead_ends(bitmask, sorted(full + lazy), states)
    return bitmask, full, lazy
