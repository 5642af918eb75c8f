"""SamplingParams: the per-request sampling controls, vLLM names, validated on construction.

Every numeric field has a finite, bounded range, so a value that passes here cannot overflow
the step's tensors (``top_k`` is an int64 tensor and an int32 in the Triton kernel) or turn
the logits into garbage (``temperature`` 1e308, ``repetition_penalty`` 1e-300).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from specdec.structured_output.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5
MAX_TEMPERATURE = 2.0  # OpenAI's range
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.1, 10.0
MAX_INT32 = 2**31 - 1


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    # specdec extension: opt this request out of speculation (decodes normally in the same batch).
    use_speculation: bool = True
    # constrain the output to a grammar (JSON schema, regex, choice, EBNF); vLLM's name
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.structured_outputs, dict):
            unknown = set(self.structured_outputs) - set(StructuredOutputsParams.__dataclass_fields__)
            if unknown:
                raise ValueError(f"SamplingParams.structured_outputs has unknown fields {sorted(unknown)}")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("SamplingParams.structured_outputs must be a StructuredOutputsParams, a dict of its "
                             f"fields or None, got {type(self.structured_outputs).__name__}")
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, value, rule: str):
            raise ValueError(f"SamplingParams.{name} must be {rule}, got {value!r}")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def in_range(v, lo: float, hi: float) -> bool:  # NaN and the infinities fail
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and lo <= v <= hi

        if not is_int(self.n) or not 1 <= self.n <= MAX_INT32:
            bad("n", self.n, f"an integer in [1, {MAX_INT32}]")
        if not in_range(self.temperature, 0.0, MAX_TEMPERATURE):
            bad("temperature", self.temperature, f"a number in [0, {MAX_TEMPERATURE:g}]")
        if not in_range(self.top_p, 0.0, 1.0) or self.top_p == 0:
            bad("top_p", self.top_p, "in (0, 1]")
        if not is_int(self.top_k) or not 0 <= self.top_k <= MAX_INT32:
            bad("top_k", self.top_k, f"an integer in [0, {MAX_INT32}] (or -1 to disable)")
        if not in_range(self.min_p, 0.0, 1.0):
            bad("min_p", self.min_p, "in [0, 1]")
        # seed + n - 1 (a completion's generator) stays within torch.Generator's [-2**63, 2**64)
        if self.seed is not None and (not is_int(self.seed) or not -(2**63) <= self.seed < 2**63):
            bad("seed", self.seed, "an integer in [-2**63, 2**63) or None")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_INT32):
            bad("max_tokens", self.max_tokens, f"an integer in [1, {MAX_INT32}] or None")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= MAX_INT32:
            bad("min_tokens", self.min_tokens, f"an integer in [0, {MAX_INT32}]")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", self.stop, "a non-empty string or a list of non-empty strings")
        if not all(is_int(t) and 0 <= t <= MAX_INT32 for t in self.stop_token_ids):
            bad("stop_token_ids", self.stop_token_ids, f"a list of integers in [0, {MAX_INT32}]")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            bad("logprobs", self.logprobs, "an integer in [0, 20] or None")
        if not in_range(self.presence_penalty, -2.0, 2.0):
            bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not in_range(self.frequency_penalty, -2.0, 2.0):
            bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if not in_range(self.repetition_penalty, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY):
            bad("repetition_penalty", self.repetition_penalty,
                f"in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def clone(self, **changes) -> "SamplingParams":
        values = {f: getattr(self, f) for f in self.__dataclass_fields__}
        values.update(changes)
        return SamplingParams(**values)
