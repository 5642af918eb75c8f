"""The worker's own state of a request, kept between steps (vLLM's cached request state).

Created from ``NewRequestData`` the first time a request is scheduled and dropped when the
engine reports it finished. The worker appends the tokens it decides; the scheduler's
counters (``num_computed_tokens``, block ids, the planned tree depth) are copied in from
each ``SchedulerOutput``. The proposer owns ``num_draft_computed_tokens``.
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
    spec_depth: int = 0  # this step's planned tree depth (0: the proposer's own)
    grammar: GrammarState | None = None  # structured output: the request's matcher (the worker's)
    lora_request: LoRARequest | None = None  # its adapter (None: the base model)
    _all_token_ids: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self):
        self._all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)
