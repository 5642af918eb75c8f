"""Prompt lookup first, the draft model otherwise (method "draft_model_lookup").

Per request and step, the context's own history is searched first (the suffix proposer of
``suffix.py``, which also reads earlier requests' outputs, or an n-gram match as in ``ngram.py``
of at least ``min_match`` tokens); a request whose lookup proposes at least ``min_tokens``
tokens verifies that proposal, and
only the other requests are drafted by the model (the draft model runs for those rows alone, or
not at all). Where the continuation repeats the context (a code body reusing the identifiers of
its signature and docstring, a repeated line), the lookup guesses it without a draft pass.

Lossless whatever it chooses: the choice depends only on the context, never on the target's
distribution; a lookup token is verified with q = one-hot (accepted with probability p(x),
otherwise the target samples from p renormalised without x), a drafted token with the q the
draft sampled it from, and at temperature 0 both accept exactly while the draft equals the
target's argmax. A request the model skipped keeps its draft KV where it was; the next pass
that drafts for it catches up on the tokens it missed in its first (ragged) pass.

Example (n-gram, ``min_match`` 3, ``min_tokens`` 2): the context ``... for i in range(len(numbers)):
... for j in range(len(`` ends with ``range(len(`` seen earlier, followed by ``numbers)):``:
the lookup proposes ``numbers ) ) :`` and the draft model is not run for this request.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.spec_decode.plan import TreeBudget
from specdec.spec_decode.proposer import DraftProposal, Proposer, TargetStates, TokenListProposer
from specdec.worker.request_state import CachedRequestState

LOOKUP_SOURCES = ("ngram", "suffix")


@dataclass(frozen=True)
class PromptLookupOptions:
    """``speculative_config.prompt_lookup`` of method "draft_model_lookup"."""
    source: str = "suffix"  # "suffix": the request's context and earlier requests' outputs; "ngram": the context
    # "ngram": the fewest and the most tokens of the context's suffix matched earlier (the suffix
    # proposer sizes its drafts by its own match length)
    min_match: int = 3
    max_match: int = 8
    min_tokens: int = 3  # a lookup proposing fewer tokens leaves the request to the draft model

    @classmethod
    def from_config(cls, value: dict | None) -> PromptLookupOptions:
        """Validated options from the config's dict (None: the defaults); errors name the field."""
        if value is None:
            return cls()
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config.prompt_lookup must be a dict, got {type(value).__name__}")
        known = {"source", "min_match", "max_match", "min_tokens"}
        unknown = set(value) - known
        if unknown:
            raise ValueError(f"speculative_config.prompt_lookup has unknown field(s) {sorted(unknown)}; "
                             f"known: {sorted(known)}")
        options = cls(**value)
        if options.source not in LOOKUP_SOURCES:
            raise ValueError(f"speculative_config.prompt_lookup.source must be one of {LOOKUP_SOURCES}, "
                             f"got {options.source!r}")
        for name, low in (("min_match", 1), ("max_match", options.min_match), ("min_tokens", 1)):
            v = getattr(options, name)
            if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= 64:
                raise ValueError(f"speculative_config.prompt_lookup.{name} must be an int in {low}..64, got {v!r}")
        return options


def build_lookup(options: PromptLookupOptions, max_k: int) -> TokenListProposer:
    """The token-list proposer ``options.source`` names, drafting up to ``max_k`` tokens."""
    if options.source == "suffix":
        from specdec.spec_decode.suffix import SuffixProposer

        return TokenListProposer(SuffixProposer(max_k), "suffix")
    from specdec.spec_decode.ngram import NgramProposer

    return TokenListProposer(NgramProposer(options.min_match, options.max_match, max_k), "ngram")


class LookupDraftProposer(Proposer):
    name = "draft_model_lookup"

    def __init__(self, draft: Proposer, lookup: TokenListProposer, min_tokens: int):
        self.draft = draft  # chains only: a tree's drafts could not be mixed with a lookup chain
        self.lookup = lookup
        self.min_tokens = min_tokens

    def propose(self, requests: list[CachedRequestState], num_spec: list[int],
                tree_budget: TreeBudget | None = None, grammar=None, target: TargetStates | None = None
                ) -> DraftProposal:
        if not any(num_spec):
            return DraftProposal.empty(len(requests))
        looked = self.lookup.propose(requests, num_spec).draft_token_ids  # at most k tokens each
        lookups = [d if len(d) >= min(self.min_tokens, k) else [] for d, k in zip(looked, num_spec)]
        model_ks = [0 if d else k for d, k in zip(lookups, num_spec)]
        proposal = self.draft.propose(requests, model_ks, tree_budget, grammar=grammar, target=target)
        if not any(lookups):
            return proposal
        return self._merge(proposal, lookups)

    def _merge(self, proposal: DraftProposal, lookups: list[list[int]]) -> DraftProposal:
        """The model's drafts with the lookup's in the requests it skipped; q rows request-major,
        one-hot for lookup tokens (needed only where the model's rows carry a q)."""
        drafts = [lk if lk else d for lk, d in zip(lookups, proposal.draft_token_ids)]
        probs = proposal.draft_probs
        if probs is not None:
            pieces, first = [], 0
            for lk, d in zip(lookups, proposal.draft_token_ids):
                if lk:
                    one_hot = probs.new_zeros(len(lk), probs.shape[1])
                    one_hot[torch.arange(len(lk)), torch.tensor(lk, device=probs.device)] = 1.0
                    pieces.append(one_hot)
                else:
                    pieces.append(probs[first:first + len(d)])
                    first += len(d)
            probs = torch.cat(pieces)
        return DraftProposal(drafts, probs, num_first_pass_rows=proposal.num_first_pass_rows,
                             num_model_passes=max(proposal.num_positions, default=0))

    def on_request_finished(self, request: CachedRequestState) -> None:
        self.draft.on_request_finished(request)
        self.lookup.on_request_finished(request)

    def reset_history(self) -> None:
        self.draft.reset_history()
        self.lookup.reset_history()


def validate(spec) -> None:
    from specdec.spec_decode.methods import _validate_draft_model

    _validate_draft_model(spec)
    PromptLookupOptions.from_config(spec.prompt_lookup)


def build(spec, runner, vocab_size, parts):
    """The draft model's proposer (``methods._build_draft_model``) behind the lookup."""
    from specdec.spec_decode.methods import _build_draft_model

    options = PromptLookupOptions.from_config(spec.prompt_lookup)
    return LookupDraftProposer(_build_draft_model(spec, runner, vocab_size, parts), build_lookup(options, spec.max_k),
                               options.min_tokens)
