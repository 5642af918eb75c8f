"""Speculative-decoding counters: drafts, draft tokens, accepted tokens per position, timings.

``AcceptanceCounts`` is the one acceptance counter: per-draft outcomes (positions drafted,
positions accepted), from which every acceptance figure is derived; the engine's metrics and
the benchmarks both keep one.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specdec.outputs import SpecDecodeStats

if TYPE_CHECKING:
    from specdec.engine.step_record import StepRecord


@dataclass
class AcceptanceCounts:
    """Per-draft outcomes: how many tokens were drafted and how many of them were accepted."""
    outcomes: Counter = field(default_factory=Counter)  # (num_drafted, num_accepted) -> count

    def add(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted:
            self.outcomes[(num_drafted, num_accepted)] += 1

    @property
    def num_drafts(self) -> int:
        return sum(self.outcomes.values())

    @property
    def num_draft_tokens(self) -> int:
        return sum(d * n for (d, _), n in self.outcomes.items())

    @property
    def num_accepted_tokens(self) -> int:
        return sum(a * n for (_, a), n in self.outcomes.items())

    @property
    def num_rejections(self) -> int:
        return sum(n for (d, a), n in self.outcomes.items() if a < d)

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (vLLM's definition)."""
        d = self.num_draft_tokens
        return self.num_accepted_tokens / d if d else 0.0

    @property
    def alpha(self) -> float:
        """accepted / tried: the maximum-likelihood per-token acceptance probability."""
        tried = self.num_accepted_tokens + self.num_rejections
        return self.num_accepted_tokens / tried if tried else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step: 1 + accepted / drafts."""
        n = self.num_drafts
        return 1.0 + self.num_accepted_tokens / n if n else 1.0

    @property
    def mean_k(self) -> float:
        n = self.num_drafts
        return self.num_draft_tokens / n if n else 0.0

    def per_position(self) -> tuple[list[int], list[int]]:
        """(drafts that reached position i, drafts accepted at position i) for every position."""
        max_k = max((d for d, _ in self.outcomes), default=0)
        drafted, accepted = [0] * max_k, [0] * max_k
        for (d, a), n in self.outcomes.items():
            for pos in range(d):
                drafted[pos] += n
                if pos < a:
                    accepted[pos] += n
        return drafted, accepted

    def acceptance_per_position(self) -> list[float]:
        """P(position i accepted | position i drafted): alpha^(i+1) under the i.i.d. model."""
        drafted, accepted = self.per_position()
        return [a / d if d else 0.0 for a, d in zip(accepted, drafted)]

    def merge(self, other: AcceptanceCounts) -> None:
        self.outcomes.update(other.outcomes)

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens, "acceptance_rate": self.acceptance_rate,
            "alpha": self.alpha, "mean_acceptance_length": self.mean_acceptance_length, "mean_k": self.mean_k,
            "acceptance_per_position": self.acceptance_per_position(),
        }


@dataclass
class SpecDecodeMetrics:
    method: str = "none"
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    positions: AcceptanceCounts = field(default_factory=AcceptanceCounts)  # (positions drafted, accepted) per draft
    k_histogram: Counter = field(default_factory=Counter)  # K actually used per request-step (incl. 0)
    num_steps: int = 0
    num_emitted_tokens: int = 0
    num_forced_tokens: int = 0  # structured output: tokens a grammar forced, no target decision needed
    time_drafting: float = 0.0
    time_target: float = 0.0
    time_sampling: float = 0.0
    time_grammar: float = 0.0  # structured output: matchers and masks
    time_comm: float = 0.0  # tensor parallelism: collectives and the step broadcast

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
        self.positions.add(positions, num_accepted)

    def observe_step(self, record: StepRecord) -> None:
        """A committed step: every verification after a request's first token, and the timings."""
        sched, result = record.scheduled, record.result
        for i, tokens in enumerate(result.sampled_token_ids):
            if tokens and sched.num_output_tokens[i]:  # a decode/verify step, not a prompt's first token
                self.observe(result.num_draft_tokens[i], result.num_accepted_tokens[i],
                             result.num_draft_positions[i])
        self.num_emitted_tokens += record.total_emitted_tokens
        self.num_forced_tokens += sum(result.num_forced_tokens)
        self.num_steps += 1
        self.time_drafting += result.draft_seconds
        self.time_target += result.target_seconds
        self.time_sampling += result.sampling_seconds
        self.time_comm += result.comm_seconds
        self.time_grammar += result.grammar_seconds

    @property
    def stats(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens)

    def as_dict(self) -> dict:
        s = self.stats
        _, accepted_per_pos = self.positions.per_position()
        return {
            "method": self.method,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": s.acceptance_rate,
            "mean_acceptance_length": s.mean_acceptance_length,
            "acceptance_per_position": self.positions.acceptance_per_position(),
            "num_accepted_tokens_per_pos": accepted_per_pos,
            "k_histogram": dict(sorted(self.k_histogram.items())),
            "num_steps": self.num_steps,
            "num_emitted_tokens": self.num_emitted_tokens,
            "num_forced_tokens": self.num_forced_tokens,
            "time_drafting_s": self.time_drafting,
            "time_target_s": self.time_target,
            "time_sampling_s": self.time_sampling,
            "time_comm_s": self.time_comm,
            "time_grammar_s": self.time_grammar,
        }
