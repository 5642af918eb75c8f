"""Request: the plain state object the scheduler, runner and engine read and advance."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from specdec.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    # owned by the scheduler: tokens whose KV is in the target cache
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prefix-cache hit at admission
    num_preemptions: int = 0
    # owned by the engine (speculation): draft tokens verified this step, and the K wanted next
    spec_token_ids: list[int] = field(default_factory=list)
    num_spec_tokens_wanted: int = 0
    spec_depth_wanted: int = 0  # token trees with adaptive K: the planned depth (slots are wanted for the tree)
    # owned by the draft proposer: tokens whose KV is in the draft cache
    num_draft_computed_tokens: int = 0
    generator: torch.Generator | None = None
    stop_reason: int | str | None = None
    output_text: str = ""
    # owned by the output processor: output_text covers output_token_ids[:detok_read_offset];
    # tokens from detok_prefix_offset on are re-decoded as context for the next piece
    detok_prefix_offset: int = 0
    detok_read_offset: int = 0
    output_logprobs: list[dict[int, float]] | None = None
    # metrics
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    _all_token_ids: list[int] = field(default_factory=list, repr=False)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + output, kept incrementally (read-only for callers: append via append_output_token)."""
        if len(self._all_token_ids) != self.num_tokens:
            self._all_token_ids = self.prompt_token_ids + self.output_token_ids
        return self._all_token_ids

    def append_output_token(self, token: int) -> None:
        self.output_token_ids.append(token)
        self._all_token_ids.append(token)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_decoding(self) -> bool:
        """Only the newest token lacks KV: this step verifies drafts (or decodes one token)."""
        return self.num_tokens - self.num_computed_tokens == 1

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens or 1 << 62
