"""Explorer: drafts K = 1 in steps planned at K = 0 while drafting could still pay, within its budget."""
import pytest

from specdec.engine.scheduler_output import SchedulerOutput
from specdec.engine.step_record import StepRecord
from specdec.spec_decode.acceptance import AcceptanceEstimator
from specdec.spec_decode.cost_model import StepCostModel
from specdec.spec_decode.explorer import Explorer
from specdec.worker.model_runner_output import ModelRunnerOutput

STEP_S = 0.04


def costs(v1=1.5) -> StepCostModel:
    """Verification rows at v(1) = ``v1``: K = 1 pays only at acceptance above v1 - 1."""
    model = StepCostModel((1, 2, 3, 4, 8))
    for rows in (1, 2, 3, 4, 8):
        model.set("target", rows, STEP_S * (1 + (v1 - 1) * (rows - 1)))
    return model


def step(ids, num_drafted, num_accepted, step_seconds=STEP_S) -> StepRecord:
    n = len(ids)
    sched = SchedulerOutput(list(ids), [0] * n, [1] * n, [[0] * d for d in num_drafted], list(num_drafted),
                            [0] * n, [1] * n, [[] for _ in ids])
    result = ModelRunnerOutput(list(ids), [[0] * (a + 1) for a in num_accepted], [[] for _ in ids],
                               list(num_drafted), list(num_accepted), list(num_drafted), [None] * n)
    return StepRecord(sched, result, [a + 1 for a in num_accepted], step_seconds)


def test_no_exploring_before_a_plain_step_has_priced_the_budget():
    explorer = Explorer(AcceptanceEstimator(), max_k=4, draft_is_model=False)
    model = costs()
    assert explorer.plan(["r"], 0, model, 0.0) is None
    explorer.observe(step(["r"], [0], [0]), model)
    assert explorer.credit == pytest.approx(0.02 * 128 * STEP_S)  # a window's saving, at once
    assert explorer.plan(["a", "b"], 0, model, 0.0) == [1, 1]


def test_the_budget_earns_on_plain_steps_up_to_a_window():
    explorer = Explorer(AcceptanceEstimator(), max_k=4, draft_is_model=False, share=0.02, window=4)
    model = costs()
    explorer.observe(step(["r"], [0], [0]), model)
    explorer.credit = 0.0
    for num_steps in range(1, 7):
        explorer.observe(step(["r"], [0], [0]), model)
        assert explorer.credit == pytest.approx(0.02 * STEP_S * min(num_steps, 4))


def test_the_budget_pays_for_rejected_drafts_and_is_refunded_for_accepted_ones():
    explorer = Explorer(AcceptanceEstimator(), max_k=4, draft_is_model=False)
    model = costs(v1=1.5)
    explorer.observe(step(["r"], [0], [0]), model)
    extra = 0.5 * STEP_S  # the price of one more row
    explorer.credit = extra
    assert explorer.plan(["r"], 0, model, 0.0) == [1]
    explorer.observe(step(["r"], [0], [0]), model)  # the step that proposed the draft: plain, earns
    explorer.observe(step(["r"], [1], [0]), model)  # the step that verified it: rejected, pays the row
    assert explorer.credit == pytest.approx(0.02 * STEP_S)
    assert explorer.plan(["r"], 0, model, 0.0) is None  # cannot afford another yet
    explorer.credit = extra
    assert explorer.plan(["r"], 0, model, 0.0) == [1]
    explorer.observe(step(["r"], [0], [0]), model)
    explorer.observe(step(["r"], [1], [1]), model)  # accepted: a token at a plain step's price
    assert explorer.credit == pytest.approx(0.02 * STEP_S + STEP_S)
    explorer.observe(step(["r"], [3], [0]), model)  # drafts it did not plan (the policy's own) cost nothing
    assert explorer.credit == pytest.approx(0.02 * STEP_S + STEP_S)


def test_exploring_stops_while_evidence_says_drafts_fail_and_resumes_as_it_ages():
    acceptance = AcceptanceEstimator()
    explorer = Explorer(acceptance, max_k=4, draft_is_model=False)
    model = costs(v1=1.5)
    explorer.observe(step(["r"], [0], [0]), model)
    for _ in range(30):
        acceptance.update("old", 1, 0)
    assert explorer.plan(["r"], 0, model, 0.0) is None  # the optimistic bound (0.19) is priced out
    idle = 0
    while explorer.plan(["r"], 0, model, 0.0) is None:
        acceptance.age_pooled()
        idle += 1
    assert 100 < idle < 600, idle  # the bound passes 0.5 again after ~350 steps of pooled_idle_decay 0.995
    # on a flat-cost target (v(1) = 1.05) the same evidence still leaves room to explore
    assert Explorer(acceptance, 4, False).plan(["r"], 0, model, 0.0) is None  # (no budget seen yet)
    cheap = Explorer(acceptance, 4, False)
    cheap.observe(step(["r"], [0], [0]), model)
    for _ in range(30):
        acceptance.update("old", 1, 0)
    assert cheap.plan(["r"], 0, costs(v1=1.05), 0.0) == [1]
    assert cheap.plan(["r"], 0, model, 0.0) is None


def test_settings_are_validated():
    for bad in (dict(share=1.0), dict(share=-0.1), dict(window=0), dict(z=-1.0)):
        with pytest.raises(ValueError, match="bad Explorer settings"):
            Explorer(AcceptanceEstimator(), 4, False, **bad)
