"""The proposer interface shared by every speculation method (one file per method)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property

import torch

from specdec.spec_decode.plan import TreeBudget
from specdec.worker.request_state import CachedRequestState


@dataclass
class DraftProposal:
    draft_token_ids: list[list[int]]  # per request of the batch; [] where nothing is proposed
    draft_probs: torch.Tensor | None  # [num_draft_total, V] q each token was sampled from; None => one-hot
    # token trees (``specdec.spec_decode.tree``): per request, each draft token's parent (-1: the newest
    # real token); None => every request's drafts form a chain
    draft_parents: list[list[int]] | None = None
    # adaptive trees: the accepted tokens the draft's own probabilities predict for this step
    expected_accepted: float | None = None
    # rows of the draft's first pass (its catch-up on tokens it has not seen: 1-2 per request in
    # steady decoding, a whole prompt after a prefill); 0 for proposers without a model
    num_first_pass_rows: int = 0
    expected_by_request: list[float] | None = None  # adaptive trees: ``expected_accepted`` per request
    # draft-model passes run when not every drafted position cost one (a lookup filled some
    # requests: ``lookup_draft.py``); None => the deepest position drafted
    num_model_passes: int | None = None

    @classmethod
    def empty(cls, num_requests: int) -> DraftProposal:
        return cls([[] for _ in range(num_requests)], None)

    @property
    def num_draft_tokens(self) -> list[int]:
        return [len(d) for d in self.draft_token_ids]

    @cached_property
    def tree_depths(self) -> list[list[int]] | None:
        """Per request, each tree node's depth (computed once: the target pass, the commit and
        the controller all read it); None for chains."""
        if self.draft_parents is None:
            return None
        from specdec.spec_decode.tree import depths

        return [depths(p) for p in self.draft_parents]

    @property
    def num_positions(self) -> list[int]:
        """Per request, the positions drafted: K for a chain, the depth for a tree."""
        if self.tree_depths is None:
            return self.num_draft_tokens
        return [max(d, default=0) for d in self.tree_depths]

    @property
    def is_tree(self) -> bool:
        return self.draft_parents is not None

    def keep_drafts(self, kept: list[list[int] | None]) -> DraftProposal:
        """Only the drafts ``kept[i]`` (indices, in order; None: all) of each request; a kept tree
        node's ancestors must be kept too."""
        tokens, parents, prob_rows, first = [], [] if self.is_tree else None, [], 0
        for i, drafts in enumerate(self.draft_token_ids):
            keep = range(len(drafts)) if kept[i] is None else kept[i]
            tokens.append([drafts[n] for n in keep])
            prob_rows.extend(first + n for n in keep)
            first += len(drafts)
            if parents is not None:
                index = {n: j for j, n in enumerate(keep)}
                parents.append([index[self.draft_parents[i][n]] if self.draft_parents[i][n] >= 0 else -1
                                for n in keep])
        probs = self.draft_probs
        if probs is not None:
            probs = probs.index_select(0, torch.tensor(prob_rows, dtype=torch.int64, device=probs.device))
        return DraftProposal(tokens, probs, parents, self.expected_accepted, self.num_first_pass_rows,
                             self.expected_by_request, self.num_model_passes)

    def row_histories(self, i: int) -> list[list[int]]:
        """Request i's verification rows (1 + its drafts): the drafts before each scored position."""
        drafts = self.draft_token_ids[i]
        if self.draft_parents is None:
            return [drafts[:j] for j in range(len(drafts) + 1)]
        from specdec.spec_decode.tree import row_histories

        return row_histories(drafts, self.draft_parents[i])


@dataclass
class TargetStates:
    """The target's states of the step just verified, for proposers that draft from them (EAGLE).
    Request i fed rows ``offsets[i]``... from position ``starts[i]`` and kept the first
    ``num_kept[i]`` of them (its scheduled tokens and accepted drafts; an accepted tree path
    already moved to consecutive rows)."""
    hidden: torch.Tensor  # [T, H] final hidden states of every fed row (EAGLE-3: [T, n * H_t] aux layer inputs)
    starts: list[int]
    offsets: list[int]
    num_kept: list[int]


class Proposer(ABC):
    """Proposes the next step's drafts right after a step's verification: each request's
    ``num_computed_tokens`` then covers what the target kept, and its newest token (the one
    the target just decided) is the only one without target KV."""
    name: str = "proposer"
    needs_target_hidden: bool = False  # True: ``propose`` needs the step's ``TargetStates``, every step

    @abstractmethod
    def propose(self, requests: list[CachedRequestState], num_spec: list[int],
                tree_budget: TreeBudget | None = None, grammar=None, target: TargetStates | None = None
                ) -> DraftProposal:
        """Up to ``num_spec[i]`` draft tokens for each request (0 => none); ``tree_budget``
        prices verification rows for proposers that size their trees by it; ``grammar`` (the
        worker's ``StructuredOutputStage``) masks the draft rows of constrained requests, for
        proposers that sample from a distribution (the others' drafts are pruned after);
        ``target``: the step's target states (only for ``needs_target_hidden``)."""

    def on_request_finished(self, request: CachedRequestState) -> None:
        """Called once when a request ends (the suffix proposer learns from it)."""

    def reset_history(self) -> None:
        """Forget what finished requests taught (benchmark repetitions must not learn from each other)."""


class TokenListProposer(Proposer):
    """Adapter for draft-free proposers that work on plain token lists (n-gram, suffix)."""

    def __init__(self, impl, name: str):
        self.impl = impl
        self.name = name

    def propose(self, requests: list[CachedRequestState], num_spec: list[int],
                tree_budget: TreeBudget | None = None, grammar=None, target: TargetStates | None = None
                ) -> DraftProposal:
        if not any(num_spec):
            return DraftProposal.empty(len(requests))
        drafts = self.impl.propose([r.all_token_ids for r in requests], num_spec, [r.request_id for r in requests])
        return DraftProposal([list(d)[:k] for d, k in zip(drafts, num_spec)], None)

    def on_request_finished(self, request: CachedRequestState) -> None:
        self.impl.on_request_finished(request.request_id, request.all_token_ids,
                                      num_prompt_tokens=request.num_prompt_tokens)

    def reset_history(self) -> None:
        if hasattr(self.impl, "reset_history"):
            self.impl.reset_history()
