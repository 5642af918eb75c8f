"""Speculative-decoding counters: drafts, draft tokens, accepted tokens per position, timings."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

from specdec.outputs import SpecDecodeStats

if TYPE_CHECKING:
    from specdec.engine.step_record import StepRecord


@dataclass
class SpecDecodeMetrics:
    method: str = "none"
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_per_pos: list[int] = field(default_factory=list)
    num_drafted_per_pos: list[int] = field(default_factory=list)
    k_histogram: Counter = field(default_factory=Counter)  # K actually used per request-step (incl. 0)
    num_steps: int = 0
    num_emitted_tokens: int = 0
    time_drafting: float = 0.0
    time_target: float = 0.0
    time_sampling: float = 0.0

    def observe(self, num_drafted: int, num_accepted: int, num_positions: int | None = None) -> None:
        """One request's verification: ``num_drafted`` tokens over ``num_positions`` positions (a
        chain: the same; a token tree: its depth), ``num_accepted`` of them kept."""
        positions = num_drafted if num_positions is None else num_positions
        self.k_histogram[positions] += 1
        if num_drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        while len(self.num_drafted_per_pos) < positions:
            self.num_drafted_per_pos.append(0)
            self.num_accepted_per_pos.append(0)
        for pos in range(positions):
            self.num_drafted_per_pos[pos] += 1
            if pos < num_accepted:
                self.num_accepted_per_pos[pos] += 1

    def observe_step(self, record: StepRecord) -> None:
        """A committed step: every verification after a request's first token, and the timings."""
        sched, result = record.scheduled, record.result
        for i, tokens in enumerate(result.sampled_token_ids):
            if tokens and sched.num_output_tokens[i]:  # a decode/verify step, not a prompt's first token
                self.observe(result.num_draft_tokens[i], result.num_accepted_tokens[i],
                             result.num_draft_positions[i])
        self.num_emitted_tokens += record.total_emitted_tokens
        self.num_steps += 1
        self.time_drafting += result.draft_seconds
        self.time_target += result.target_seconds
        self.time_sampling += result.sampling_seconds

    @property
    def stats(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens)

    def as_dict(self) -> dict:
        s = self.stats
        return {
            "method": self.method,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": s.acceptance_rate,
            "mean_acceptance_length": s.mean_acceptance_length,
            "acceptance_per_position": [
                a / d if d else 0.0 for a, d in zip(self.num_accepted_per_pos, self.num_drafted_per_pos)
            ],
            "num_accepted_tokens_per_pos": list(self.num_accepted_per_pos),
            "k_histogram": dict(sorted(self.k_histogram.items())),
            "num_steps": self.num_steps,
            "num_emitted_tokens": self.num_emitted_tokens,
            "time_drafting_s": self.time_drafting,
            "time_target_s": self.time_target,
            "time_sampling_s": self.time_sampling,
        }
