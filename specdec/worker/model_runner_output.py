"""What a worker returns for one step: per scheduled request, the tokens the target decided,
the acceptance counts and the drafts it proposed for the next step, plus the step's timings.
Picklable, no tensors: the draft distributions q stay on the worker, keyed by request."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelRunnerOutput:
    request_ids: list[str] = field(default_factory=list)  # the batch, as scheduled
    # per request: accepted drafts, then the target's own token (recovered or bonus); [] for a
    # prefill chunk that does not complete its prompt
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    # per request: drafts proposed right after this step's verification, to verify next step (a
    # token tree's nodes in topological order); [] where none were
    draft_token_ids: list[list[int]] = field(default_factory=list)
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
    num_draft_first_pass_rows: int = 0  # rows of the proposal's first (catch-up) pass
    num_draft_passes: int = 0  # the proposal's draft-model passes (K of a chain, a tree's depth; 0 without a model)
    # adaptive trees: accepted drafts the draft's probabilities predicted for the drafts verified
    expected_accepted: float | None = None
    draft_seconds: float = 0.0  # proposing the next step's drafts
    target_seconds: float = 0.0
    sampling_seconds: float = 0.0
    grammar_seconds: float = 0.0  # structured output: matchers and masks (part of the above)
    comm_seconds: float = 0.0  # tensor parallelism: inside the model's collectives (part of the above)
