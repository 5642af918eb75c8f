"""Request: the scheduler's plain state object for one sequence, with one owner per field.

Ownership (who writes each field; everyone else only reads):
- ``EngineCore.add_request``: ``request_id``, ``prompt_token_ids``, ``sampling_params``,
  ``eos_token_ids``, ``seed``, ``arrival_time``, ``lora_request``.
- ``Scheduler`` (``schedule`` / ``update_from_output`` / ``finish``): ``status``,
  ``num_computed_tokens``, ``num_cached_prompt_tokens``, ``num_preemptions``, the output
  tokens and logprobs (appended by the commit), ``first_token_time`` / ``last_token_time``,
  the per-request speculation counters ``num_drafts`` / ``num_draft_tokens`` /
  ``num_accepted_tokens``, and ``spec_token_ids`` (the drafts the worker proposed for the
  next step, from its output).
- ``OutputProcessor`` (called by the commit): ``output_text``, ``stop_reason`` and the
  detokenizer offsets.
The worker keeps its own copy of what it needs (``specdec.worker.request_state``); the draft
KV count and the seeded generator live there, not here.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from specdec.lora.request import LoRARequest
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


class TokenSequence:
    """Prompt + output token bookkeeping shared by the scheduler's ``Request`` and the worker's
    ``CachedRequestState``: both hold ``prompt_token_ids``, ``output_token_ids`` and
    ``_all_token_ids`` (prompt + output, kept incrementally)."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    _all_token_ids: list[int]

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
        """Prompt + output (read-only for callers: append via append_output_token)."""
        if len(self._all_token_ids) != self.num_tokens:
            self._all_token_ids = self.prompt_token_ids + self.output_token_ids
        return self._all_token_ids

    def append_output_token(self, token: int) -> None:
        self.output_token_ids.append(token)
        self._all_token_ids.append(token)

    def append_output_tokens(self, tokens: list[int]) -> None:
        self.output_token_ids.extend(tokens)
        self._all_token_ids.extend(tokens)

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens or 1 << 62


@dataclass(eq=False)
class Request(TokenSequence):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    seed: int | None = None  # the worker's generator for this request is seeded with it
    arrival_time: float = field(default_factory=time.monotonic)
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the target cache
    num_cached_prompt_tokens: int = 0  # prefix-cache hit at admission
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    output_text: str = ""
    # output_text covers output_token_ids[:detok_read_offset]; tokens from detok_prefix_offset on
    # are re-decoded as context for the next piece
    detok_prefix_offset: int = 0
    detok_read_offset: int = 0
    output_logprobs: list[dict[int, float]] | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify next step (the worker's proposal)
    _all_token_ids: list[int] = field(default_factory=list, repr=False)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_decoding(self) -> bool:
        """Only the newest token lacks KV: this step verifies drafts (or decodes one token)."""
        return self.num_tokens - self.num_computed_tokens == 1
