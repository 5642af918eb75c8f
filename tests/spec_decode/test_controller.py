"""SpecController: "auto" K from the cost model, acceptance estimates, the guard and the queue."""
import random

import pytest
from specdec.engine.request import Request
from specdec.engine.scheduler_output import SchedulerOutput
from specdec.engine.step_record import StepRecord
from specdec.sampling_params import SamplingParams
from specdec.spec_decode.controller import SpecController
from specdec.worker.model_runner_output import ModelRunnerOutput


def record(ids, num_drafted, num_accepted, num_scheduled=None, target_seconds=0.01, step_seconds=0.02) -> StepRecord:
    """A committed step in which request ids[i] verified num_drafted[i] chain drafts, accepting num_accepted[i],
    and drafted as many again for the next step (a steady K)."""
    n = len(ids)
    sched = SchedulerOutput(list(ids), [0] * n, num_scheduled or [1] * n, [[0] * d for d in num_drafted],
                            list(num_drafted), [0] * n, [1] * n, [[] for _ in ids])
    result = ModelRunnerOutput(list(ids), [[0] * (a + 1) for a in num_accepted], [[0] * d for d in num_drafted],
                               list(num_drafted), list(num_accepted), list(num_drafted), [None] * n,
                               num_draft_passes=max(num_drafted, default=0), target_seconds=target_seconds)
    return StepRecord(sched, result, [a + 1 for a in num_accepted], step_seconds)


def ks(ctl, running, closed_batch=False) -> list[int]:
    plan = ctl.plan(running, closed_batch)
    return [plan.num_spec_tokens.get(r.request_id, 0) for r in running]


def decoding(rid: str, max_tokens: int, generated: int) -> Request:
    req = Request(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens))
    for t in range(generated):
        req.append_output_token(4 + t % 7)
    req.num_computed_tokens = req.num_tokens - 1  # one token to feed: decoding
    return req


def controller(max_model_len=None) -> SpecController:
    ctl = SpecController(max_k=4, adaptive=True, draft_is_model=False, max_model_len=max_model_len)
    for n in (1, 2, 4, 8, 16, 32):
        ctl.cost.set("target", n, 0.05 + 0.004 * n)  # verification rows cost something
    for rid in ("lead", "lag"):
        for _ in range(20):
            ctl.acceptance.update(rid, 4, 3)  # acceptance ~0.75
    return ctl


def test_a_closed_batch_keeps_drafts_for_the_request_that_ends_it():
    lead, lag = decoding("lead", 256, 240), decoding("lag", 256, 40)  # 16 vs 216 tokens to go
    ctl = controller()
    k = ks(ctl, [lead, lag], closed_batch=True)
    assert k[0] == 0 and k[1] > 0
    # open to new requests (a server, or a queue waiting): finishing the leader early frees a slot
    ctl = controller()
    k = ks(ctl, [lead, lag], closed_batch=False)
    assert k[0] > 0 and k[1] > 0


def test_remaining_budget_is_capped_by_the_context():
    unbounded = Request("u", [1, 2, 3], SamplingParams(max_tokens=None))
    assert controller(max_model_len=100).remaining_budget(unbounded) == 97
    assert controller(max_model_len=100).remaining_budget(decoding("b", 20, 5)) == 15


def test_equal_budgets_plan_as_before():
    a, b = decoding("lead", 256, 40), decoding("lag", 256, 40)
    ctl = controller()
    alone = ks(ctl, [a, b], closed_batch=True)
    ctl = controller()
    queued = ks(ctl, [a, b], closed_batch=False)
    assert alone == queued and alone[0] > 0


def test_a_plan_that_drafts_nothing_is_reused_a_few_steps_until_acceptance_changes():
    a, b = decoding("lead", 256, 40), decoding("lag", 256, 40)
    ctl = controller()
    ctl.cost.set("target", 4, 1.0)  # verification rows now cost far more than they could return
    ctl.guard.allow = lambda num_decoding: True  # (its own early plain steps would skip plans too)
    calls = []
    original = ctl.acceptance.position_acceptances
    ctl.acceptance.position_acceptances = lambda ids: calls.append(ids) or original(ids)
    for _ in range(6):
        assert ks(ctl, [a, b]) == [0, 0]
    assert len(calls) == 2  # planned, reused 4 times, planned again
    for _ in range(26):  # each plan that again drafts nothing doubles the reuse: 4, 8, 16 (cap 32)
        assert ks(ctl, [a, b]) == [0, 0]
    assert len(calls) == 4  # steps 0, 5, 14, 31
    ctl.observe(record(["lead"], [2], [2]))  # new evidence: plan afresh, and every 5th step again
    for _ in range(6):
        ks(ctl, [a, b])
    assert len(calls) == 6


def test_the_cost_model_is_fed_the_rows_the_target_ran_not_the_slots_reserved():
    ctl = controller()
    seen = []
    ctl.cost.observe = lambda kind, num_tokens, seconds: seen.append((kind, num_tokens))
    # K = 4 reserved for each of 4 requests, but the proposer found drafts for one only
    step = record([f"r{i}" for i in range(4)], [2, 0, 0, 0], [1, 0, 0, 0])
    step.scheduled.num_spec_slots = [4] * 4
    ctl.observe(step)
    assert seen == [("target", 6)]


def test_observe_updates_acceptance_from_the_step_record():
    ctl = controller()
    before = ctl.acceptance.acceptance("fresh")
    for _ in range(10):
        ctl.observe(record(["fresh", "other"], [4, 0], [0, 0]))  # fresh rejects every draft; other drafted nothing
    assert ctl.acceptance.acceptance("fresh") < before
    # a request that drafted nothing learnt nothing of its own: it reads the pooled prior, as an unseen one does
    assert ctl.acceptance.acceptance("other") == ctl.acceptance.acceptance("never-seen")


def test_a_request_that_stopped_drafting_drafts_again_as_its_evidence_ages():
    """A new request whose first drafts were rejected plans K = 0 (its estimate sits below the
    pooled one); drafting nothing it observes nothing. Its evidence ages by one step per step that
    drafted nothing, so it drafts again within a few dozen steps instead of decoding plainly to its end."""
    def target_s(rows):
        return 0.05 * (1 + 0.5 * (rows - 1))

    ctl = SpecController(max_k=4, adaptive=True, draft_is_model=True)
    for n in (1, 2, 4, 8):
        ctl.cost.set("target", n, target_s(n))
        ctl.cost.set("draft", n, 0.012)
    ctl.guard.allow = lambda num_decoding: True
    for _ in range(40):
        ctl.acceptance.update("earlier", 4, 2)  # the pool: about 0.7 per position
    req = decoding("r", 4096, 10)
    assert ks(ctl, [req]) == [2]
    for _ in range(5):  # its first drafts all rejected
        step = record(["r"], [4], [0], target_seconds=target_s(5))
        step.result.draft_seconds = 4 * 0.012
        ctl.observe(step)
    assert ks(ctl, [req]) == [0]
    plans = []
    for _ in range(60):
        plans.append(ks(ctl, [req])[0])
        if plans[-1]:
            break
        ctl.observe(record(["r"], [0], [0], target_seconds=target_s(1)))  # nothing drafted, nothing learnt
    assert plans[-1] > 0 and len(plans) <= 40, plans
    assert ks(ctl, [decoding("new", 4096, 10)])[0] > 0  # the pool still says drafting pays


def test_a_fixed_policy_plans_k_for_every_decoding_request_and_learns_nothing():
    fixed = SpecController.fixed(3)
    a, b = decoding("lead", 256, 40), decoding("lag", 256, 40)
    assert ks(fixed, [a, b]) == [3, 3]
    fixed.observe(record(["lead"], [3], [0]))  # nothing to learn into
    assert fixed.acceptance is None and ks(fixed, [a, b]) == [3, 3]
    assert ks(SpecController.fixed(0), [a]) == [0]


def test_auto_explores_a_few_steps_when_the_prior_alone_says_no():
    """Costs under which the prior acceptance (0.5) makes K = 0 optimal: without evidence "auto"
    drafts max_k for a few steps, learns a strong draft pays and keeps drafting; a poor draft
    stops after those few steps and is not retried."""
    for accepted, keeps_drafting in ((4, True), (0, False)):
        ctl = SpecController(max_k=4, adaptive=True, draft_is_model=True)
        for n in (1, 2, 4, 8):
            ctl.cost.set("target", n, 0.1 * (1 + 0.6 * (n - 1)))  # verification rows are costly
            ctl.cost.set("draft", n, 0.02)
        ctl.guard.allow = lambda num_decoding: True
        req = decoding("r", 256, 10)
        plans = []
        for _ in range(12):
            k = ks(ctl, [req])[0]
            plans.append(k)
            if k:
                ctl.observe(record(["r"], [k], [min(accepted, k)]))
        assert plans[0] == 4  # explored despite the prior
        assert ctl._num_explored <= ctl.explore_max_steps
        if keeps_drafting:
            assert all(plans), plans  # a draft accepted in full: worth it at these costs
        else:
            assert plans[-6:] == [0] * 6 and sum(1 for k in plans if k) == ctl.explore_max_steps, plans


def simulate_tokens_per_second(conditional, draft_s, target_s, row_s, fixed_k=None, max_k=8, steps=400, seed=0):
    """Closed loop at batch 1 on simulated costs: the real controller plans K (or ``fixed_k``), a
    synthetic draft is accepted at position j with probability ``conditional[j]`` (the last one
    repeats), and the controller observes each step as the engine would report it."""
    rng = random.Random(seed)
    ctl = SpecController(max_k=max_k, adaptive=fixed_k is None, draft_is_model=True)
    if fixed_k is None:
        for n in (1, 2, 4, 8, 16, 32, 64):
            ctl.cost.set("target", n, target_s + row_s * (n - 1))
            ctl.cost.set("draft", n, draft_s * (1 + 0.05 * (n - 1)))
    req = decoding("r", 100_000, 10)
    seconds = tokens = 0
    for _ in range(steps):
        k = ks(ctl, [req])[0] if fixed_k is None else fixed_k
        accepted = 0
        while accepted < k and rng.random() < conditional[min(accepted, len(conditional) - 1)]:
            accepted += 1
        step = record(["r"], [k], [accepted], target_seconds=target_s + row_s * k,
                      step_seconds=k * draft_s + target_s + row_s * k)
        step.result.draft_seconds = k * draft_s
        if fixed_k is None:
            ctl.observe(step)
        seconds += step.step_seconds
        tokens += accepted + 1
    return tokens / seconds


@pytest.mark.parametrize("case, conditional, draft_s, floor", [
    # a 0.5B draft of a 1.5B target on code: deeper positions accepted more often than the first
    ("strong, rising with depth", [0.89, 0.93, 0.95, 0.95, 0.96], 0.038, 0.97),
    ("i.i.d. 0.8", [0.8], 0.038, 0.97),
    ("drifting", [0.8, 0.7, 0.6, 0.5, 0.4], 0.038, 0.97),
    ("cheap head, i.i.d. 0.7", [0.7], 0.005, 0.97),
    # best fixed K = 0: "auto" pays its few exploring steps (4 at K = 8 in 400 steps)
    ("poor draft", [0.3], 0.038, 0.96),
])
def test_auto_k_keeps_up_with_the_best_fixed_k(case, conditional, draft_s, floor):
    """Seeds 0-4, 400 steps each: the median of "auto" against the best fixed K in 0..8 (mean over
    the same seeds). The first case needs untried positions priced like the ones before them; the
    second, a guard that does not read batch-1 noise as a loss."""
    target_s, row_s, seeds = 0.095, 0.0025, range(5)
    best = max(sum(simulate_tokens_per_second(conditional, draft_s, target_s, row_s, fixed_k=k, seed=s)
                   for s in seeds) / len(seeds) for k in range(9))
    auto = sorted(simulate_tokens_per_second(conditional, draft_s, target_s, row_s, seed=s) for s in seeds)
    assert auto[len(auto) // 2] >= floor * best, (case, [a / best for a in auto])


def test_a_draft_pass_that_caught_up_on_a_prompt_is_not_priced_as_a_draft_pass():
    """The step after a prefill: the draft's first pass ran over the whole prompt. Priced as one
    pass of one row it would make drafting look many times dearer, and "auto" would then draft
    nothing and never see a cheap pass again."""
    ctl = SpecController(max_k=4, adaptive=True, draft_is_model=True)
    for n in (1, 2, 4, 8):
        ctl.cost.set("target", n, 0.05)
        ctl.cost.set("draft", n, 0.01)
    caught_up = record(["r"], [2], [2])
    caught_up.result.draft_seconds, caught_up.result.num_draft_first_pass_rows = 0.4, 60
    ctl.observe(caught_up)
    assert ctl.cost.cost("draft", 1) == pytest.approx(0.01)
    steady = record(["r"], [2], [2])
    steady.result.draft_seconds, steady.result.num_draft_first_pass_rows = 0.03, 2
    ctl.observe(steady)
    assert ctl.cost.cost("draft", 1) == pytest.approx(0.0125)  # (0.01 + 0.015) / 2: observed
