import itertools
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.spec_decode.acceptance import AcceptanceEstimator
from specdec.spec_decode.adaptive import (
    choose_num_spec_tokens,
    choose_num_tree_nodes,
    completion_weights,
    expected_tokens,
)
from specdec.spec_decode.cost_model import StepCostModel

COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def cost_model(target, draft=None, counts=COUNTS) -> StepCostModel:
    """A model whose knots hold target(n) / draft(n) exactly."""
    model = StepCostModel(counts)
    for n in counts:
        model.observe("target", n, target(n))
        if draft is not None:
            model.observe("draft", n, draft(n))
    return model


def flat_until(limit, seconds=0.05):  # memory-bound up to `limit` tokens, then compute-bound
    return lambda n: seconds * max(1.0, n / limit)


# ---- expected_tokens ------------------------------------------------------------------

def test_expected_tokens_closed_form_and_limits():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(1.0 - 1e-12, 7) == pytest.approx(8.0)
    assert expected_tokens(0.8, 4) == pytest.approx(sum(0.8**j for j in range(5)))
    # "auto" reports a mean K: the closed form holds for any real K >= 0
    assert expected_tokens(0.5, 1.5) == pytest.approx((1 - 0.5**2.5) / 0.5)
    with pytest.raises(ValueError, match="alpha"):
        expected_tokens(1.5, 3)
    with pytest.raises(ValueError, match="k"):
        expected_tokens(0.5, -1)


# ---- StepCostModel ----------------------------------------------------------------------

def test_cost_model_interpolates_between_knots_and_extrapolates():
    model = StepCostModel((1, 8, 64))
    assert model.cost("target", 5) == 1.0 and model.cost("draft", 5) == 0.0  # unobserved defaults
    model.observe("target", 8, 0.010)
    assert model.cost("target", 64) == pytest.approx(0.010)  # one knot: assume flat (memory-bound)
    model.observe("target", 64, 0.050)
    assert model.cost("target", 8) == pytest.approx(0.010)
    assert model.cost("target", 36) == pytest.approx(0.030)  # halfway between 8 and 64
    assert model.cost("target", 2) == pytest.approx(0.010)  # flat below the first observed knot
    assert model.cost("target", 120) == pytest.approx(0.050 + 56 * 0.040 / 56)  # last slope continues
    model.observe("target", 128, 0.160)  # above the last knot: folded in as 0.080 at 64
    assert model.cost("target", 64) == pytest.approx(0.065)  # second observation: running mean
    assert model.cost("target", 0) == 0.0
    with pytest.raises(ValueError, match="kind"):
        model.observe("verifier", 8, 0.1)
    with pytest.raises(ValueError, match="token_counts"):
        StepCostModel((4, 2))


def test_calibrated_only_knots_scale_with_what_real_steps_measured():
    model = StepCostModel((1, 8, 32, 64, 128))
    for n in (1, 8, 32, 64):  # start-up calibration: short contexts, cheap
        model.set("target", n, 0.010 + 0.0005 * n)
    assert model.cost("target", 64) == pytest.approx(0.042)
    for _ in range(50):  # real batch-32 decode steps cost twice the calibrated 32-token pass
        model.observe("target", 32, 2 * 0.026)
    assert model.cost("target", 32) == pytest.approx(0.052, rel=0.01)
    # 64 was never seen by a real step: it scales by the same 2x, so 32 -> 64 tokens is not free
    assert model.cost("target", 64) == pytest.approx(2 * 0.042, rel=0.01)
    assert model.cost("target", 8) == pytest.approx(2 * 0.014, rel=0.01)
    # so a low-acceptance batch of 32 does not speculate (+20% tokens for +60% time); with the
    # stale 0.042 at 64 it would have (+20% tokens in a pass the curve said was cheaper)
    assert choose_num_spec_tokens([0.2] * 32, 5, model) == [0] * 32
    # and once a real step measures 64, its own value is used
    for _ in range(50):
        model.observe("target", 64, 0.060)
    assert model.cost("target", 64) == pytest.approx(0.060, rel=0.01)
    # a knot measured cheaper than a smaller one (other step mixes) reads as no cheaper
    for _ in range(50):
        model.observe("target", 128, 0.050)
    assert model.cost("target", 128) == pytest.approx(0.060, rel=0.01)
    assert model.cost("target", 96) == pytest.approx(0.060, rel=0.01)


def test_cost_model_learns_a_line_from_off_knot_observations_and_tracks_drift():
    model = StepCostModel((1, 16, 64), ema_rate=0.05)
    rng = random.Random(0)
    for _ in range(3000):
        n = rng.randint(1, 64)
        model.observe("target", n, 0.02 + 0.001 * n)
    for n in (1, 10, 16, 40, 64):
        assert model.cost("target", n) == pytest.approx(0.02 + 0.001 * n, rel=0.02)
    for _ in range(200):  # the machine got 2x slower: the EMA follows
        model.observe("target", 16, 0.072)
    assert model.cost("target", 16) == pytest.approx(0.072, rel=0.01)


def test_calibrate_times_the_callable_with_the_given_timer():
    clock = [0.0]
    calls = []

    def run_fn(kind, num_tokens):
        calls.append((kind, num_tokens))
        clock[0] += 0.01 + 0.001 * num_tokens if kind == "target" else 0.002

    model = StepCostModel((1, 4, 16))
    measured = model.calibrate(run_fn, kinds=("target", "draft"), token_counts=(1, 4, 16), timer=lambda: clock[0])
    assert measured[("target", 16)] == pytest.approx(0.026)
    assert model.cost("target", 4) == pytest.approx(0.014)
    assert model.cost("draft", 10) == pytest.approx(0.002)
    assert len(calls) == 2 * 3 * (1 + 3)  # kinds x counts x (warmup + repeats)


# ---- AcceptanceEstimator ----------------------------------------------------------------

def accept_stream(rng, alpha, k):
    num_accepted = 0
    while num_accepted < k and rng.random() < alpha:
        num_accepted += 1
    return num_accepted


@pytest.mark.parametrize("alpha", [0.1, 0.5, 0.85])
def test_estimator_converges_on_iid_streams(alpha):
    rng = random.Random(1)
    estimator = AcceptanceEstimator(decay=1.0)
    for _ in range(3000):
        estimator.update("r", 5, accept_stream(rng, alpha, 5))
    assert estimator.acceptance("r") == pytest.approx(alpha, abs=0.02)
    for position, estimate in enumerate(estimator.position_acceptance("r")[:3]):
        num_trials = 3000 * alpha**position  # position j is tried only after j - 1 acceptances
        assert estimate == pytest.approx(alpha, abs=4 * (alpha * (1 - alpha) / num_trials) ** 0.5)  # 4 sigma


def test_estimator_tracks_a_change_and_uses_the_pooled_prior():
    rng = random.Random(2)
    estimator = AcceptanceEstimator(decay=0.95)
    for _ in range(300):
        estimator.update("r", 6, accept_stream(rng, 0.9, 6))
    assert estimator.acceptance("r") > 0.8
    for _ in range(150):
        estimator.update("r", 6, accept_stream(rng, 0.3, 6))
    # ~20 effective steps of its own against 8 pseudo-trials of the pooled estimate (~0.6)
    assert 0.25 < estimator.acceptance("r") < 0.45
    assert 0.3 < estimator.acceptance("new") < 0.9  # unseen request: pooled estimate
    estimator.forget("r")
    assert estimator.acceptance("r") == estimator.acceptance("new")
    with pytest.raises(ValueError, match="num_accepted"):
        estimator.update("r", 2, 3)


def test_pooled_evidence_ages_in_idle_steps_and_the_optimistic_bound_reads_it():
    """A policy that stopped drafting observes nothing: its pooled evidence that drafts fail must
    fade with the steps (``age_pooled``), so the optimistic bound the explorer reads rises again."""
    estimator = AcceptanceEstimator()
    assert estimator.optimistic_position_acceptance(0.0)[0] == pytest.approx(0.5)
    assert estimator.optimistic_position_acceptance(1.645)[0] == pytest.approx(0.5 + 1.645 * (0.25 / 9) ** 0.5)
    for _ in range(30):
        estimator.update("r", 1, 0)
    mean = estimator.unseen_position_acceptance()
    bound = estimator.optimistic_position_acceptance(1.645)
    assert mean[0] == pytest.approx(4 / 38, abs=0.005) and bound[0] == pytest.approx(0.19, abs=0.01)
    assert (bound >= mean).all()  # the whole profile shifts up
    for _ in range(400):  # 0.995 per idle step: 30 trials -> 4
        estimator.age_pooled()
    assert estimator.num_pooled_trials == pytest.approx(sum(0.999 ** i for i in range(30)) * 0.995 ** 400)
    assert estimator.optimistic_position_acceptance(1.645)[0] > 0.5
    assert estimator.unseen_position_acceptance()[0] > 0.3  # back towards the prior
    with pytest.raises(ValueError, match="pooled_idle_decay"):
        AcceptanceEstimator(pooled_idle_decay=0.0)


def test_estimator_sees_bursty_per_position_acceptance():
    rng = random.Random(3)  # copy-like proposer: the first token is a coin flip, then all accepted
    estimator = AcceptanceEstimator(decay=1.0)
    for _ in range(2000):
        estimator.update("r", 4, 4 if rng.random() < 0.5 else 0)
    positions = estimator.position_acceptance("r")
    assert positions[0] == pytest.approx(0.5, abs=0.04) and min(positions[1:4]) > 0.99
    assert estimator.acceptance("r") == pytest.approx(0.8, abs=0.04)  # i.i.d. view: 4 / (4 + 1)


# ---- choose_num_spec_tokens -------------------------------------------------------------

def throughput(ks, alphas, cost, num_other_tokens=0, weights=None):
    weights = weights or [1.0] * len(ks)
    gain = sum(w * expected_tokens(a, k) for a, k, w in zip(alphas, ks, weights)) + num_other_tokens
    rows = [sum(k >= d for k in ks) for d in range(1, max(ks, default=0) + 1)]
    seconds = cost.cost("target", sum(k + 1 for k in ks) + num_other_tokens) + sum(cost.cost("draft", r) for r in rows)
    return gain / seconds


def test_no_speculation_when_it_cannot_pay():
    linear = cost_model(lambda n: 0.001 * n)
    assert choose_num_spec_tokens([0.8, 0.95, 1.0], 8, linear) == [0, 0, 0]
    draft_as_slow_as_target = cost_model(lambda n: 0.05, lambda n: 0.05)
    assert choose_num_spec_tokens([0.8, 0.9], 8, draft_as_slow_as_target) == [0, 0]
    cheap_draft = cost_model(flat_until(64), lambda n: 0.003)
    assert choose_num_spec_tokens([0.01, 0.02], 8, cheap_draft) == [0, 0]
    assert choose_num_spec_tokens([0.0], 8, cost_model(flat_until(64))) == [0]


def test_full_speculation_when_acceptance_is_high_and_verification_flat():
    assert choose_num_spec_tokens([0.999] * 4, 8, cost_model(flat_until(256))) == [8] * 4
    with_draft = cost_model(flat_until(256), lambda n: 0.002)
    assert choose_num_spec_tokens([0.99] * 4, 8, with_draft) == [8] * 4
    assert choose_num_spec_tokens([1.0], 16, StepCostModel()) == [16]  # uncalibrated: flat target, free draft


def test_flat_region_budget_and_prefill_pressure():
    cost = cost_model(flat_until(32))  # one pass of <= 32 tokens costs the same
    ks = choose_num_spec_tokens([0.9, 0.9, 0.9, 0.9], 16, cost)
    assert 20 <= sum(ks) <= 28 and max(ks) - min(ks) <= 1  # fill the free region, no further
    assert choose_num_spec_tokens([0.9] * 4, 16, cost, num_other_tokens=2000) == [0] * 4


def test_prefers_requests_with_higher_acceptance():
    cost = cost_model(flat_until(16))
    ks = choose_num_spec_tokens([0.3, 0.95, 0.7, 0.99], 8, cost)
    assert ks[0] <= ks[2] <= ks[1] <= ks[3] and ks[3] > ks[0]


def test_per_position_alphas_value_bursty_drafts():
    cost = cost_model(lambda n: 0.05 + 0.01 * n)
    assert choose_num_spec_tokens([0.6], 8, cost) == [2]  # i.i.d. view: the third token is worth only 0.22
    assert choose_num_spec_tokens([[0.6, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]], 8, cost) == [8]


@settings(max_examples=60, deadline=None)
@given(alpha=st.floats(0.0, 0.99), delta=st.floats(0.0, 0.5), slope=st.floats(0.0, 0.01), draft=st.floats(0.0, 0.03))
def test_monotone_in_alpha(alpha, delta, slope, draft):
    cost = cost_model(lambda n: 0.05 + slope * n, lambda n: draft)
    low = choose_num_spec_tokens([alpha], 10, cost)[0]
    high = choose_num_spec_tokens([min(1.0, alpha + delta)], 10, cost)[0]
    assert low <= high


def test_exact_optimum_for_free_drafts_by_brute_force():
    rng = random.Random(4)
    for _ in range(30):
        knee, slope = rng.choice([4, 8, 16]), rng.uniform(0.0, 0.02)
        cost = cost_model(lambda n: 0.05 * (1 + slope * max(0, n - knee)))
        alphas = [rng.random() for _ in range(3)]
        ks = choose_num_spec_tokens(alphas, 4, cost)
        best = max(throughput(c, alphas, cost) for c in itertools.product(range(5), repeat=3))
        assert throughput(ks, alphas, cost) == pytest.approx(best, rel=1e-9)


def test_completion_weights_fade_requests_that_will_finish_first():
    assert completion_weights([256, 128, 0]) == [1.0, 0.5, 1 / 256]  # a finished budget still counts a little
    assert completion_weights([40, 40, 40]) == [1.0, 1.0, 1.0]
    assert completion_weights([]) == []


def test_weights_take_drafts_from_requests_that_are_ahead():
    cost = cost_model(lambda n: 0.05 + 0.004 * n)  # verification rows cost something
    assert choose_num_spec_tokens([0.7, 0.7], 8, cost) == choose_num_spec_tokens([0.7, 0.7], 8, cost,
                                                                                weights=[1.0, 1.0])
    even = choose_num_spec_tokens([0.7, 0.7], 8, cost)
    ahead = choose_num_spec_tokens([0.7, 0.7], 8, cost, weights=[1.0, 0.1])
    assert even[0] == even[1] > 0
    assert ahead[1] == 0 and ahead[0] > 0  # the request that ends the batch keeps its drafts
    with pytest.raises(ValueError, match="weights"):
        choose_num_spec_tokens([0.7, 0.7], 8, cost, weights=[1.0, 0.0])


def test_exact_optimum_with_weights_by_brute_force():
    rng = random.Random(7)
    for _ in range(30):
        slope = rng.uniform(0.0, 0.02)
        cost = cost_model(lambda n: 0.05 * (1 + slope * n))
        alphas = [rng.random() for _ in range(3)]
        weights = [rng.uniform(0.05, 1.0) for _ in range(3)]
        ks = choose_num_spec_tokens(alphas, 4, cost, weights=weights)
        best = max(throughput(c, alphas, cost, weights=weights) for c in itertools.product(range(5), repeat=3))
        assert throughput(ks, alphas, cost, weights=weights) == pytest.approx(best, rel=1e-9)


def test_validation_and_empty_batch():
    assert choose_num_spec_tokens([], 4, StepCostModel()) == []
    with pytest.raises(ValueError, match="max_k"):
        choose_num_spec_tokens([0.5], -1, StepCostModel())
    with pytest.raises(ValueError, match=r"alphas\[1\]"):
        choose_num_spec_tokens([0.5, 1.2], 4, StepCostModel())
    with pytest.raises(ValueError, match="num_other_tokens"):
        choose_num_spec_tokens([0.5], 4, StepCostModel(), num_other_tokens=-3)
    assert np.all(np.array(choose_num_spec_tokens([0.5] * 300, 16, StepCostModel())) == 16)


def test_throughput_guard_backs_off_when_speculating_steps_are_slower():
    from specdec.spec_decode.throughput_guard import ThroughputGuard

    guard = ThroughputGuard(probe_every=8, min_steps=4)
    # no plain rate yet: every other step is plain (free against speculation off) until there is one
    assert [guard.allow(4) for _ in range(6)] == [True, False] * 3
    for _ in range(4):
        guard.observe(4, speculated=False, tokens=4, seconds=0.008)
    # speculation allowed, with a plain probe every 8th step of the bucket
    assert [guard.allow(4) for _ in range(10)] == [True] + [False] + [True] * 7 + [False]
    for _ in range(6):
        guard.observe(4, speculated=True, tokens=5, seconds=0.012)   # 417 tokens/s
        guard.observe(4, speculated=False, tokens=4, seconds=0.008)  # 500 tokens/s
    guard._steps.clear()  # count the bucket's steps from here
    assert guard.rate(4, "spec") < guard.rate(4, "plain")
    decisions = [guard.allow(5) for _ in range(64)]  # 5 decoding requests: same bucket as 4
    # only probes speculate, ever rarer while the loss holds: 8, then 16, then 32 steps apart
    assert [i for i, d in enumerate(decisions) if d] == [8, 24, 56]
    # other batch sizes keep their own evidence (none yet: speculation allowed on the first step)
    assert guard.allow(16)
    # drafts start paying: the spec rate recovers past the plain one and speculation resumes
    for _ in range(30):
        guard.observe(4, speculated=True, tokens=6, seconds=0.011)  # 545 tokens/s: ahead, not by far
    assert guard.rate(4, "spec") > guard.rate(4, "plain")
    guard._steps.clear()
    assert sum(guard.allow(4) for _ in range(64)) == 64 - 8  # a plain probe every 8th step
    for _ in range(30):
        guard.observe(4, speculated=True, tokens=12, seconds=0.012)  # 2x plain: the plain rate is checked rarely
    guard._steps.clear()
    assert sum(guard.allow(4) for _ in range(64)) == 64 - 1


def test_throughput_guard_does_not_call_noise_a_loss():
    """At batch 1 a speculating step emits 1..K+1 tokens: a few unlucky steps of a good draft
    average below plain decoding without being a loss. The same mean with no spread is one."""
    from specdec.spec_decode.throughput_guard import ThroughputGuard

    noisy, steady = ThroughputGuard(min_steps=6), ThroughputGuard(min_steps=6)
    for guard in (noisy, steady):
        for _ in range(8):
            guard.observe(1, speculated=False, tokens=1, seconds=0.1)  # 10 tokens/s
    for tokens in (1, 1, 6, 1, 2, 1):  # mean 2 tokens per 0.21 s: 9.5 tokens/s
        noisy.observe(1, speculated=True, tokens=tokens, seconds=0.21)
        steady.observe(1, speculated=True, tokens=2, seconds=0.21)
    assert noisy.rate(1, "spec") == pytest.approx(steady.rate(1, "spec"))
    assert noisy.rate(1, "spec") < noisy.rate(1, "plain")
    assert sum(noisy.allow(1) for _ in range(8)) == 8  # not losing beyond the noise: speculation goes on
    assert sum(steady.allow(1) for _ in range(8)) == 0  # a loss every step: backs off
    with pytest.raises(ValueError, match="z="):
        ThroughputGuard(z=-1.0)


def test_throughput_guard_forgets_speculating_evidence_in_proportion_to_new_requests():
    from specdec.spec_decode.throughput_guard import ThroughputGuard

    guard = ThroughputGuard(min_steps=4)
    for batch in (1, 32):
        for _ in range(10):
            guard.observe(batch, speculated=True, tokens=batch, seconds=0.02)  # losing: as many tokens, slower
            guard.observe(batch, speculated=False, tokens=batch, seconds=0.01)
    guard.requests_changed(32, 1 / 32)  # one new request among 32: the evidence stands
    assert guard.rate(32, "spec") is not None and not guard.allow(32)
    guard.requests_changed(32, 1.0)  # a whole new batch of 32 moves the batch's mean little
    assert guard.rate(32, "spec") is not None
    guard.requests_changed(1, 1.0)  # a new request alone: no speculating evidence about it yet
    assert guard.rate(1, "spec") is None and guard.rate(1, "plain") == pytest.approx(100.0)
    assert guard.allow(1)


def test_throughput_guard_keeps_a_clear_win_across_a_new_request_until_its_rate_says_otherwise():
    """At batch 1 each request resets the speculating evidence; a guard that had seen speculation
    far ahead keeps probing plain decoding rarely meanwhile, and a new request that loses is still
    caught as soon as its own rate is known."""
    from specdec.spec_decode.throughput_guard import ThroughputGuard

    guard = ThroughputGuard(probe_every=8, min_steps=4, max_backoff=8)
    for _ in range(8):
        guard.observe(1, speculated=False, tokens=1, seconds=0.01)  # 100 tokens/s
        guard.observe(1, speculated=True, tokens=5, seconds=0.02)  # 250 tokens/s: far ahead
    assert sum(guard.allow(1) for _ in range(64)) == 64 - 1
    guard.requests_changed(1, 1.0)
    assert guard.rate(1, "spec") is None
    guard._steps.clear()
    assert sum(guard.allow(1) for _ in range(64)) == 64 - 1  # not one probe every 8 steps
    fresh = ThroughputGuard(probe_every=8, min_steps=4, max_backoff=8)  # never saw a win: probes every 8
    for _ in range(8):
        fresh.observe(1, speculated=False, tokens=1, seconds=0.01)
    assert sum(fresh.allow(1) for _ in range(64)) == 64 - 8
    for _ in range(4):  # the new request's drafts lose: its own rate ends the inherited verdict
        guard.observe(1, speculated=True, tokens=1, seconds=0.02)
    guard._steps.clear()
    assert sum(guard.allow(1) for _ in range(64)) < 8


def test_throughput_guard_ignores_empty_steps_and_rejects_bad_settings():
    from specdec.spec_decode.throughput_guard import ThroughputGuard

    guard = ThroughputGuard(min_steps=1)
    guard.observe(2, speculated=True, tokens=0, seconds=0.01)
    guard.observe(2, speculated=True, tokens=3, seconds=0.0)
    assert guard.rate(2, "spec") is None
    with pytest.raises(ValueError, match="probe_every"):
        ThroughputGuard(probe_every=1)


def test_an_untried_position_is_assumed_to_be_accepted_like_the_one_before_it():
    """Drafts that always stop at K = 2 say nothing about position 3: its estimate is position 2's,
    not the flat prior."""
    estimator = AcceptanceEstimator(prior_acceptance=0.5)
    for _ in range(200):
        estimator.update("r", 2, 2)  # both drafts accepted, every step
    positions = estimator.position_acceptance("r")
    assert positions[0] > 0.95 and positions[1] > 0.95
    assert positions[2] == pytest.approx(positions[1], abs=0.01) and positions[7] > 0.9
    assert estimator.position_acceptance("unseen")[2] > 0.95  # the pooled profile carries it too


def test_a_request_shifts_the_pooled_position_profile_by_its_own_acceptance():
    estimator = AcceptanceEstimator(decay=0.95)
    rng = random.Random(5)
    for _ in range(400):  # the profile: bursty (position 1 a coin flip, then nearly always accepted)
        estimator.update("old", 4, 4 if rng.random() < 0.5 else 0)
    for _ in range(60):
        estimator.update("good", 4, 4 if rng.random() < 0.9 else 0)
        estimator.update("poor", 4, 4 if rng.random() < 0.1 else 0)
    pooled, good, poor = (np.array(estimator.position_acceptance(r)[:4]) for r in ("new", "good", "poor"))
    assert (good > pooled).all() and (poor < pooled).all()
    assert good[0] > 0.7 and poor[0] < 0.4
    assert min(good[1:]) > 0.95 and min(poor[1:]) > 0.7  # the shape stays the pooled one: bursty


def test_vectorised_position_acceptances_match_the_per_request_ones():
    est = AcceptanceEstimator(max_positions=6)
    rng = random.Random(3)
    for rid in ("a", "b", "c"):
        for _ in range(rng.randint(1, 9)):
            k = rng.randint(1, 6)
            est.update(rid, k, rng.randint(0, k))
    ids = ["a", "b", "unseen", "c"]
    table = est.position_acceptances(ids)
    assert table.shape == (4, 6)
    np.testing.assert_allclose(table, [est.position_acceptance(r) for r in ids])
    cost = cost_model(lambda n: 0.05 + 0.004 * n)
    assert choose_num_spec_tokens(table, 8, cost) == choose_num_spec_tokens([list(row) for row in table], 8, cost)


# ---- choose_num_tree_nodes (adaptive token trees) -----------------------------------------

@pytest.mark.parametrize("target", [flat_until(16), lambda n: 0.01 + 0.002 * n, lambda n: 0.004 * n ** 1.3],
                         ids=["flat-then-linear", "linear", "convex"])
def test_tree_nodes_chosen_are_the_best_set_by_brute_force(target):
    """Against every combination of per-request prefixes (3 requests, up to 4 nodes each, 30
    random gain sets): the chosen node counts reach the best tokens per second."""
    cost = cost_model(target)
    rng = random.Random(0)
    for _ in range(30):
        gains = [sorted((rng.random() ** 2 for _ in range(rng.randint(0, 4))), reverse=True) for _ in range(3)]
        base, sunk = rng.randint(1, 6), rng.choice([0.0, 0.005])

        def rate(counts):
            value = base + sum(sum(g[:n]) for g, n in zip(gains, counts))
            return value / (sunk + float(cost.costs("target", np.array([base + sum(counts)]))[0]))

        best = max(rate(c) for c in itertools.product(*[range(len(g) + 1) for g in gains]))
        chosen = choose_num_tree_nodes(gains, base, cost, sunk)
        assert all(0 <= n <= len(g) for n, g in zip(chosen, gains))
        assert rate(chosen) == pytest.approx(best, rel=1e-9)


def test_tree_nodes_follow_the_price_of_rows():
    gains = [[0.6, 0.3, 0.12, 0.05, 0.02, 0.01]]
    assert choose_num_tree_nodes(gains, 1, cost_model(lambda n: 0.02)) == [6]  # rows free: every node
    assert choose_num_tree_nodes(gains, 1, cost_model(lambda n: 0.02 * n)) == [0]  # a row costs a token
    some = choose_num_tree_nodes(gains, 1, cost_model(lambda n: 0.02 + 0.001 * n))[0]
    assert 1 <= some < 6
    assert choose_num_tree_nodes([[], []], 2, cost_model(lambda n: 0.02)) == [0, 0]


def test_throughput_guard_learns_the_plain_rate_in_two_plain_steps():
    """A fresh engine at batch 1: every other step is plain until the plain rate is known. A plain
    step emits one token in about the same time every time, so two fix it; the speculating arm,
    whose steps emit 1..K+1 tokens, still needs six before the guard may call it a loss."""
    from specdec.spec_decode.throughput_guard import ThroughputGuard

    guard = ThroughputGuard()
    plain_steps = []
    for step in range(40):
        speculating = guard.allow(1)
        if not speculating:
            plain_steps.append(step)
        guard.observe(1, speculated=speculating, tokens=5 if speculating else 1, seconds=0.1 if speculating else 0.05)
    assert plain_steps == [1, 3]
    assert guard.rate(1, "plain") == pytest.approx(20.0)
    losing = ThroughputGuard()
    for _ in range(5):  # speculation slower than plain, but only 5 steps of it: not yet a verdict
        losing.observe(1, speculated=True, tokens=1, seconds=0.1)
        losing.observe(1, speculated=False, tokens=1, seconds=0.05)
    assert losing.rate(1, "spec") is None and losing.allow(1)
    losing.observe(1, speculated=True, tokens=1, seconds=0.1)
    assert not any(losing.allow(1) for _ in range(8))
