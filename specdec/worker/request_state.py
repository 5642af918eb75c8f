"""The worker's own state of a request, kept between steps (vLLM's cached request state).

Created from ``NewRequestData`` the first time a request is scheduled and dropped when the
engine reports it finished. The worker appends the tokens it decides; the scheduler's
counters (``num_computed_tokens``, block ids, the planned tree depth) are copied in from
each ``SchedulerOutput`` and ``num_computed_tokens`` is moved past the rows the target kept
before the next drafts are proposed. The proposer owns ``num_draft_computed_tokens``; the
worker keeps the drafts it proposed (with their q) in ``next_drafts`` until the step that
verifies them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from typing import TYPE_CHECKING

import torch

from specdec.engine.request import TokenSequence
from specdec.lora.request import LoRARequest
from specdec.sampling_params import SamplingParams

if TYPE_CHECKING:
    from specdec.structured_output.grammar_state import GrammarState


@dataclass
class PendingDrafts:
    """Drafts proposed for a request's next step, with what only the worker needs to verify them."""
    token_ids: list[int]
    parents: list[int] | None  # a token tree's parents (-1: the newest token); None for a chain
    probs: torch.Tensor | None  # [len(token_ids), V] float32, q each draft was sampled from; None => one-hot
    expected_accepted: float | None = None  # adaptive trees: what the draft's probabilities predict


@dataclass(eq=False)
class CachedRequestState(TokenSequence):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    generator: torch.Generator | None  # seeded requests draw only from their own
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # the scheduler's count at the start of this step
    num_draft_computed_tokens: int = 0  # tokens whose draft KV is valid (the proposer's)
    block_ids: list[int] = field(default_factory=list)  # the scheduler's, this step
    group_block_ids: tuple[list[int], ...] = ()  # the other KV cache groups' blocks, this step
    spec_depth: int = 0  # the planned tree depth of the drafts proposed this step (0: the proposer's own)
    grammar: GrammarState | None = None  # structured output: the request's matcher (the worker's)
    lora_request: LoRARequest | None = None  # its adapter (None: the base model)
    next_drafts: PendingDrafts | None = None  # proposed at the end of the last step it was scheduled in
    _all_token_ids: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self):
        self._all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)
