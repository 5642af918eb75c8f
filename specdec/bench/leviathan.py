"""What speculation can give at best: the Leviathan et al. (2023) bound (acceptance is measured
with ``spec_decode.metrics.AcceptanceCounts``).

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

from specdec.spec_decode.adaptive import expected_tokens


def leviathan_bound(alpha: float, k: int, cost_ratio: float) -> float:
    """Speedup bound over plain decoding: (1 - a^(K+1)) / ((1 - a)(cK + 1))."""
    if cost_ratio < 0:
        raise ValueError(f"cost_ratio must be >= 0, got {cost_ratio}")
    return expected_tokens(alpha, k) / (cost_ratio * k + 1.0)
