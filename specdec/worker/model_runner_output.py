"""What a worker returns for one step: per scheduled request, the tokens the target decided
and the acceptance counts, plus the step's timings. Picklable, no tensors."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelRunnerOutput:
    request_ids: list[str] = field(default_factory=list)  # the batch, as scheduled
    # per request: accepted drafts, then the target's own token (recovered or bonus); [] for a
    # prefill chunk that does not complete its prompt
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    num_draft_tokens: list[int] = field(default_factory=list)  # per request: drafts verified
    num_accepted_tokens: list[int] = field(default_factory=list)  # per request: drafts kept
    num_draft_positions: list[int] = field(default_factory=list)  # per request: K of a chain, depth of a tree
    # per request, per sampled token: {token: logprob, top alternatives...} under the target's raw
    # distribution (masked by the grammar of a constrained request: a forced token has 0.0); None
    # for requests that asked for no logprobs
    logprobs: list[list[dict[int, float]] | None] = field(default_factory=list)
    # per request: tokens its grammar forced after the target's decision (no target row scored them)
    num_forced_tokens: list[int] = field(default_factory=list)
    num_target_rows: int = 0  # rows the target forward ran
    num_draft_first_pass_rows: int = 0  # rows of the draft's first (catch-up) pass
    expected_accepted: float | None = None  # adaptive trees: accepted drafts the draft's probabilities predict
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    sampling_seconds: float = 0.0
    grammar_seconds: float = 0.0  # structured output: matchers and masks (part of the above)
    comm_seconds: float = 0.0  # tensor parallelism: inside the model's collectives (part of the above)
