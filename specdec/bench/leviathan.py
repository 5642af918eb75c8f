"""What speculation can give at best: the Leviathan et al. (2023) bound, and its inputs.

With per-token acceptance probability ``alpha`` (each draft token is accepted with
probability alpha given the ones before it were), K drafts per step and a draft costing
``c`` target steps per token, one verification step emits on average
``(1 - alpha^(K+1)) / (1 - alpha)`` tokens and costs ``c*K + 1`` target steps, so

    speedup <= (1 - alpha^(K+1)) / ((1 - alpha) (c K + 1)).

Note the two "acceptance" figures: vLLM's *acceptance rate* is accepted / drafted tokens;
``alpha`` is accepted / tried tokens (a token after the first rejection is never tried).
They agree only for K = 1 or alpha in {0, 1}; the bound takes alpha.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


def expected_tokens_per_step(alpha: float, k: int) -> float:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def leviathan_bound(alpha: float, k: int, cost_ratio: float) -> float:
    """Speedup bound over plain decoding: (1 - a^(K+1)) / ((1 - a)(cK + 1))."""
    if cost_ratio < 0:
        raise ValueError(f"cost_ratio must be >= 0, got {cost_ratio}")
    return expected_tokens_per_step(alpha, k) / (cost_ratio * k + 1.0)


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

    def acceptance_per_position(self) -> list[float]:
        """P(position i accepted | position i drafted): alpha^(i+1) under the i.i.d. model."""
        max_k = max((d for d, _ in self.outcomes), default=0)
        out = []
        for pos in range(max_k):
            drafted = sum(n for (d, _), n in self.outcomes.items() if d > pos)
            accepted = sum(n for (d, a), n in self.outcomes.items() if d > pos and a > pos)
            out.append(accepted / drafted if drafted else 0.0)
        return out

    def merge(self, other: AcceptanceCounts) -> None:
        self.outcomes.update(other.outcomes)

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens, "acceptance_rate": self.acceptance_rate,
            "alpha": self.alpha, "mean_acceptance_length": self.mean_acceptance_length, "mean_k": self.mean_k,
            "acceptance_per_position": self.acceptance_per_position(),
        }
