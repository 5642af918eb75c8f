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

import torch

from specdec.spec_decode import tree
from specdec.spec_decode.proposer import DraftProposal
from specdec.structured_output.grammar_state import GrammarState
from specdec.worker.request_state import CachedRequestState


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], fallback_uniform: bool) -> None:
    """Set disallowed logits of ``rows`` to -inf in place (``bitmask`` row r masks logits row r).
    A row left with no finite logit (a draft that gives every allowed token zero probability,
    or min_tokens banning the only token the grammar allows) becomes uniform over the
    allowed tokens when ``fallback_uniform``: any q is lossless as long as it is the one used."""
    import xgrammar as xgr

    if not rows:
        return
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
    if not fallback_uniform:
        return
    index = torch.tensor(rows, device=logits.device)
    dead = logits.index_select(0, index).amax(dim=-1) == float("-inf")
    for r in index[dead.cpu()].tolist():
        allowed = unpack_row(bitmask[r], logits.shape[1]).to(logits.device)
        logits[r] = torch.where(allowed, 0.0, float("-inf"))


def unpack_row(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """One bitmask row -> [vocab_size] bool."""
    shifts = torch.arange(32, dtype=torch.int32)
    return ((words.unsqueeze(-1) >> shifts) & 1).view(-1)[:vocab_size].bool()


def mask_draft_logits(logits: torch.Tensor, reqs: list[CachedRequestState], paths: list[list[int]]) -> None:
    """Draft logits [len(reqs), V]: row j masked to what request j's grammar allows after its
    committed output + ``paths[j]`` (the tokens drafted before this row)."""
    rows = [j for j, r in enumerate(reqs) if r.grammar is not None]
    if not rows:
        return
    bitmask = GrammarState.allocate(len(reqs), logits.shape[1])
    for j in rows:
        grammar = reqs[j].grammar
        grammar.goto(paths[j])
        grammar.fill(bitmask, j)
    apply_bitmask(logits, bitmask.to(logits.device), rows, fallback_uniform=True)


def end_drafting(reqs: list[CachedRequestState]) -> None:
    """Put every grammar back at its committed output after a proposal."""
    for r in reqs:
        if r.grammar is not None:
            r.grammar.goto([])


def prune_proposal(reqs: list[CachedRequestState], num_scheduled: list[int], proposal: DraftProposal) -> DraftProposal:
    """Drop the drafts a constrained request's grammar rejects (a chain from its first rejected
    token on; a tree node and its subtree)."""
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
                         vocab_size: int) -> tuple[torch.Tensor, list[int]] | None:
    """Masks for the target's verification rows (request-major, ``histories[k]`` = request k's
    rows): (bitmask [rows, words], the rows that are constrained); None if none is."""
    if all(r.grammar is None for r in reqs):
        return None
    bitmask = GrammarState.allocate(sum(len(h) for h in histories), vocab_size)
    rows, first = [], 0
    for req, paths in zip(reqs, histories):
        if req.grammar is not None:
            req.grammar.path_masks(paths, bitmask, first)
            rows.extend(range(first, first + len(paths)))
        first += len(paths)
    return bitmask, rows
