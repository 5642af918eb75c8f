"""StepCostModel calibrated on verification shapes, and the K that "auto" plans from it: a steep
v(K) (a mixture-of-experts target, whose rows read more experts with every row) stops drafting
early or never starts; a flat one (a dense target on hardware where rows are nearly free) drafts
the most it may."""
import pytest

from specdec.spec_decode.adaptive import choose_num_spec_tokens, expected_tokens
from specdec.spec_decode.controller import SpecController
from specdec.spec_decode.cost_model import StepCostModel, shape_token_counts, verification_shapes

NUM_EXPERTS, TOP_K = 128, 8


def experts_read(rows: int) -> float:
    """Expected distinct experts of ``rows`` rows routed uniformly at random (top-8 of 128)."""
    return NUM_EXPERTS * (1.0 - (1.0 - TOP_K / NUM_EXPERTS) ** rows)


def moe_step(batch: int, rows: int) -> float:
    """A Qwen3-30B-A3B-like pass: attention + lm_head per request, experts by their union."""
    return 0.004 + 0.0005 * batch + 0.0006 * experts_read(batch * rows)


def dense_step(batch: int, rows: int) -> float:
    return 0.010 + 0.0001 * batch * rows


def calibrated(step, batch_sizes=(1, 2, 4, 8), max_rows=8) -> StepCostModel:
    shapes = verification_shapes(batch_sizes, max_rows)
    cost = StepCostModel(shape_token_counts(shapes))
    cost.calibrate_shapes(step, shapes)
    return cost


def v(cost: StepCostModel, batch: int, k: int) -> float:
    return cost.cost("target", batch * (k + 1)) / cost.cost("target", batch)


def test_calibration_times_every_batch_by_rows_shape_and_prices_each_total():
    calls = []

    def step(batch, rows):
        calls.append((batch, rows))
        return moe_step(batch, rows)

    shapes = verification_shapes((1, 2, 4, 8), 8)
    cost = StepCostModel(shape_token_counts(shapes))
    measured = cost.calibrate_shapes(step, shapes)
    assert calls == [(b, q) for b in (1, 2, 4, 8) for q in range(1, 9)] and set(measured) == set(calls)
    # every total a batch of up to 8 verifies K = 0..7 at is a knot priced by measurement
    for batch in (1, 2, 4, 8):
        for rows in range(1, 9):
            assert batch * rows in cost.token_counts
    assert cost.cost("target", 40) == pytest.approx(moe_step(8, 5))  # (8 x 5): the only shape with 40 rows
    # 8 rows: (1 x 8), (2 x 4), (4 x 2), (8 x 1) -> their median
    same = sorted(moe_step(b, 8 // b) for b in (1, 2, 4, 8))
    assert cost.cost("target", 8) == pytest.approx((same[1] + same[2]) / 2)
    with pytest.raises(ValueError, match="not a knot"):
        StepCostModel().calibrate_shapes(step, [(1, 3)])


def test_the_moe_cost_curve_is_steep_and_bends_where_the_experts_run_out():
    cost = calibrated(moe_step)
    v1 = [v(cost, 1, k) for k in range(8)]
    v8 = [v(cost, 8, k) for k in range(8)]
    assert v1[1] > 1.5 and v1[7] > 3.5  # each row adds ~8 experts at batch 1
    # at batch 8 one request's extra row adds ~8 more rows' worth of experts until all 128 are read
    assert v8[1] > 1.3 and v8[7] < v1[7]


@pytest.mark.parametrize("batch", [1, 8])
def test_a_steep_v_plans_small_k_and_none_at_low_acceptance(batch):
    cost = calibrated(moe_step)
    k_high = choose_num_spec_tokens([0.8] * batch, 7, cost, draft_per_token=False)
    if batch == 1:  # every row adds ~8 experts to one row's 8
        assert 1 <= k_high[0] <= 3, k_high
    # the planned K is the best one under the same model (no fixed K does better by its numbers);
    # at batch 8 the 8 base rows already read ~51 experts, so extra rows add fewer
    best = max(range(8), key=lambda k: expected_tokens(0.8, k) / v(cost, batch, k))
    assert k_high == [best] * batch
    assert choose_num_spec_tokens([0.3] * batch, 7, cost, draft_per_token=False) == [0] * batch


def test_a_steeper_v_plans_no_drafts_even_at_high_acceptance():
    cost = calibrated(lambda batch, rows: 0.001 + 0.001 * experts_read(batch * rows))  # experts are all of it
    assert choose_num_spec_tokens([0.8], 7, cost, draft_per_token=False) == [0]


@pytest.mark.parametrize("batch", [1, 8])
def test_a_flat_v_plans_the_largest_k(batch):
    cost = calibrated(dense_step)
    assert choose_num_spec_tokens([0.8] * batch, 7, cost, draft_per_token=False) == [7] * batch
    # negative control: on the same flat curve, drafts that are never accepted are not worth a row
    assert choose_num_spec_tokens([0.0] * batch, 7, cost, draft_per_token=False) == [0] * batch


def test_controller_calibrates_shapes_when_the_worker_gives_batch_sizes():
    timed = []

    def time_forward(kind, n):
        return 0.0 if kind == "draft" else dense_step(n, 1)

    def time_shape(batch, rows):
        timed.append((batch, rows))
        return moe_step(batch, rows)

    ctl = SpecController(max_k=5, adaptive=True, draft_is_model=False)
    ctl.calibrate(time_forward, time_shape, (1, 2, 4))
    assert timed == [(b, q) for b in (1, 2, 4) for q in range(1, 7)]
    assert ctl.cost.cost("target", 3) == pytest.approx(moe_step(1, 3))
    assert ctl.cost.cost("target", 20) == pytest.approx(moe_step(4, 5))
    # a dense target (no batch sizes): one request's 1..max_k + 1 rows, then one row per request
    # for the larger knots (decode batches)
    ctl, timed[:] = SpecController(max_k=5, adaptive=True, draft_is_model=False), []
    ctl.calibrate(time_forward, lambda batch, rows: timed.append((batch, rows)) or dense_step(batch, rows), ())
    assert timed == [(1, q) for q in range(1, 7)]
    assert ctl.cost.cost("target", 16) == pytest.approx(dense_step(16, 1))


def amx_step(batch: int, rows: int) -> float:
    """A dense w4a8 pass on a CPU whose int8 linears switch to AMX tiles from 6 rows on: below, the
    VNNI kernel's cost grows with the rows; from there, tiles make the rows nearly free."""
    total = batch * rows
    return 0.030 + (0.006 * (total - 1) if total < 6 else 0.022 + 0.0002 * total)


def test_a_dense_target_is_priced_at_every_row_count_of_one_request():
    """The AMX switch makes v(K) a step: knots at 1, 2, 4, 8 rows would draw a line from 4 rows to
    8 and price 5 rows (K = 4) below what it costs; one knot per row count reads each."""
    ctl = SpecController(max_k=7, adaptive=True, draft_is_model=False)
    ctl.calibrate(lambda kind, n: 0.0 if kind == "draft" else amx_step(n, 1), amx_step, ())
    for rows in range(1, 9):
        assert ctl.cost.cost("target", rows) == pytest.approx(max(amx_step(1, r) for r in range(1, rows + 1)))
    interpolated = StepCostModel()
    for n in (1, 2, 4, 8):
        interpolated.set("target", n, amx_step(n, 1))
    assert interpolated.cost("target", 5) < 0.98 * amx_step(1, 5)  # the smoothing the knots avoid


def test_a_per_step_overhead_makes_verification_rows_relatively_cheaper():
    cost = calibrated(lambda batch, rows: 0.001 + 0.001 * experts_read(batch * rows))
    assert choose_num_spec_tokens([0.8], 7, cost, draft_per_token=False) == [0]
    # the same forwards inside steps that spend 40 ms on scheduling, sampling and commit: K = 0 is
    # 49 ms per token, K = 2 is (40 + 23.5 ms) / 2.44 tokens = 26 ms
    k = choose_num_spec_tokens([0.8], 7, cost, draft_per_token=False, step_overhead=0.040)[0]
    assert k >= 2
    best = max(range(8), key=lambda j: expected_tokens(0.8, j) / (0.040 + cost.cost("target", j + 1)))
    assert k == best


def test_controller_learns_the_step_overhead_from_decode_steps():
    from tests.spec_decode.test_controller import record

    ctl = SpecController(max_k=4, adaptive=True, draft_is_model=False)
    assert ctl.step_overhead(1) == 0.0
    for _ in range(10):
        ctl.observe(record(["a"], [2], [1], target_seconds=0.010, step_seconds=0.035))
    assert ctl.step_overhead(1) == pytest.approx(0.025)
    assert ctl.step_overhead(8) == 0.0  # another batch bucket: not seen yet
    ctl.observe(record(["a"], [0], [0], num_scheduled=[5], target_seconds=0.01, step_seconds=0.5))  # a prefill
    assert ctl.step_overhead(1) == pytest.approx(0.025)


def test_one_request_s_rows_and_many_requests_single_rows_are_priced_apart():
    """A server alternates batch-1 verifications of 8 rows with batch-8 plain decode steps (8 rows
    too, but 8 contexts' KV to read): one knot of 8 tokens would price both at their mix, making
    K = 7 at batch 1 look dearer than it is and a batch-8 step cheaper."""
    def one_request(rows):
        return 0.030 + 0.001 * rows

    cost = StepCostModel(tuple(range(1, 10)) + (16, 32))
    for _ in range(60):
        for rows in range(1, 10):
            cost.observe("target", rows, one_request(rows), num_requests=1)
        cost.observe("target", 8, 0.050, num_requests=8)
        cost.observe("target", 16, 0.056, num_requests=8)  # batch 8 verifying one draft each
    shared = cost.cost("target", 8)
    assert one_request(8) < shared - 0.002 and shared < 0.050 - 0.002  # the mix fits neither
    assert cost.cost("target", 8, num_requests=1) == pytest.approx(one_request(8), rel=0.02)
    assert cost.cost("target", 8, num_requests=8) == pytest.approx(0.050, rel=0.02)
    assert cost.cost("target", 8, num_requests=12) == cost.cost("target", 8, num_requests=8)  # one bucket: 8-15
    assert cost.cost("target", 16, num_requests=8) == pytest.approx(0.056, rel=0.02)
    assert cost.cost("target", 8, num_requests=32) == shared  # a bucket never seen: the shared curve
    # what the planner reads: at batch 1 the rows cost what one request's rows cost
    for k in range(9):
        assert cost.cost("target", k + 1, num_requests=1) == pytest.approx(one_request(k + 1), rel=0.02)
