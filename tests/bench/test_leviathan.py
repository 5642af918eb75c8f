"""The Leviathan bound and the acceptance statistics it is fed with."""
from __future__ import annotations

import random

import pytest

from specdec.bench.leviathan import leviathan_bound
from specdec.spec_decode.adaptive import expected_tokens
from specdec.spec_decode.metrics import AcceptanceCounts


@pytest.mark.parametrize("alpha,k,c,expected", [
    (0.0, 4, 0.0, 1.0),  # nothing accepted: one token per step
    (1.0, 4, 0.0, 5.0),  # everything accepted: K + 1
    (1.0, 4, 0.25, 5.0 / 2.0),  # ... at the cost of 1 + cK
    (0.5, 1, 0.0, 1.5),
    (0.8, 5, 0.1, (1 - 0.8**6) / (0.2 * 1.5)),
    (0.0, 3, 0.5, 1.0 / 2.5),  # a useless draft is a slowdown
])
def test_bound_values(alpha, k, c, expected):
    assert leviathan_bound(alpha, k, c) == pytest.approx(expected)


def test_bound_is_continuous_at_alpha_one():
    assert leviathan_bound(1 - 1e-9, 6, 0.1) == pytest.approx(leviathan_bound(1.0, 6, 0.1), rel=1e-6)


def test_expected_tokens_matches_a_simulation():
    """(1 - a^(K+1)) / (1 - a) is the mean of 1 + (accepted prefix of K Bernoulli(a) trials)."""
    rng = random.Random(0)
    a, k, n = 0.7, 4, 40_000
    total = 0
    for _ in range(n):
        accepted = 0
        while accepted < k and rng.random() < a:
            accepted += 1
        total += 1 + accepted
    # std of tokens/step < 1.5; 40k samples -> std of the mean < 0.0075; 5 sigma tolerance
    assert total / n == pytest.approx(expected_tokens(a, k), abs=0.04)


@pytest.mark.parametrize("args", [(-0.1, 2, 0.0), (1.1, 2, 0.0), (0.5, -1, 0.0), (0.5, 2, -0.1)])
def test_bound_rejects_bad_inputs(args):
    with pytest.raises(ValueError):
        leviathan_bound(*args)


def test_alpha_counts_tried_tokens_and_rate_counts_drafted_ones():
    c = AcceptanceCounts()
    c.add(2, 2)  # both accepted
    c.add(2, 0)  # first rejected: the second was never tried
    c.add(0, 0)  # no draft: ignored
    assert c.num_drafts == 2 and c.num_draft_tokens == 4 and c.num_accepted_tokens == 2
    assert c.acceptance_rate == pytest.approx(2 / 4)
    assert c.alpha == pytest.approx(2 / 3)  # 2 accepted, 1 rejection
    assert c.mean_acceptance_length == pytest.approx(1 + 2 / 2)
    assert c.acceptance_per_position() == [0.5, 0.5]


def test_alpha_estimates_the_per_token_probability_of_a_geometric_process():
    rng = random.Random(1)
    a, k = 0.8, 5
    c = AcceptanceCounts()
    for _ in range(20_000):
        accepted = 0
        while accepted < k and rng.random() < a:
            accepted += 1
        c.add(k, accepted)
    # ~66k Bernoulli trials: std of alpha ~0.0016; tolerance 0.01 is > 6 sigma
    assert c.alpha == pytest.approx(a, abs=0.01)
    assert c.acceptance_rate < c.alpha  # drafted tokens after a rejection drag the rate down
    per_pos = c.acceptance_per_position()
    for i, p in enumerate(per_pos):
        assert p == pytest.approx(a ** (i + 1), abs=0.02)
