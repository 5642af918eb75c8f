"""SpecController: "auto" K from the cost model, acceptance estimates, the guard and the queue."""
import random

import pytest
from specdec.engine.request import Request
from specdec.engine.scheduler_output import SchedulerOutput
from specdec.engine.step_record import StepRecord
from specdec.sampling_params import SamplingParams
from specdec.spec_decode.controller import SpecController
from specdec.spec_decode.cost_model import StepCostModel
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


@pytest.mark.parametrize("left, most", [(1, 0), (2, 0), (3, 1), (4, 2)])
def test_no_drafts_past_the_tokens_a_request_has_left(left, most):
    """A request with r tokens to go emits at least one this step and at most r - 1 in the next,
    which verifies the drafts planned now: a draft past r - 2 would be dropped unseen."""
    far = ks(controller(), [decoding("lead", 64, 10)])[0]
    assert far >= 3  # far from its end
    assert ks(controller(), [decoding("lead", 64, 64 - left)]) == [most]


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
    ctl.cost.observe = lambda kind, num_tokens, seconds, num_requests=None: seen.append((kind, num_tokens, num_requests))
    # K = 4 reserved for each of 4 requests, but the proposer found drafts for one only
    step = record([f"r{i}" for i in range(4)], [2, 0, 0, 0], [1, 0, 0, 0])
    step.scheduled.num_spec_slots = [4] * 4
    ctl.observe(step)
    assert seen == [("target", 6, 4)]  # 6 rows of 4 requests: priced for that batch bucket


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


# the 12-layer Qwen3-30B-A3B-shaped Q4_K_M GGUF's measured v(K) = step(K + 1 rows) / step(1 row), batch 1:
# a mixture-of-experts target reads more experts with every row, so only good drafts pay
MOE_V = [1.0, 1.53, 1.96, 2.36, 2.75, 3.12, 3.43, 3.86]
MOE_STEP_S, MOE_OVERHEAD_S = 0.04, 0.004


def moe_controller() -> SpecController:
    ctl = SpecController(max_k=7, adaptive=True, draft_is_model=False)  # a proposer without a model (replay)
    ctl.cost = StepCostModel(tuple(range(1, 9)) + (16, 32, 64))
    for rows, v in enumerate(MOE_V, start=1):
        ctl.cost.set("target", rows, MOE_STEP_S * v)
    return ctl


def closed_loop(ctl, acceptance_at, steps, seed=0, fixed_k=None):
    """Batch 1, as the engine runs it: the drafts a step plans are proposed at its end and verified in
    the next step, each accepted with probability ``acceptance_at(step)`` (i.i.d.), on the MoE costs.
    Returns the K planned per step and the tokens per second over the run."""
    rng = random.Random(seed)
    req = decoding("r", 10**6, 10)
    pending, plans, tokens, seconds = 0, [], 0, 0.0
    for step in range(steps):
        k = ks(ctl, [req])[0] if fixed_k is None else fixed_k
        accepted = 0
        while accepted < pending and rng.random() < acceptance_at(step):
            accepted += 1
        target_s = MOE_STEP_S * MOE_V[pending]
        rec = record(["r"], [pending], [accepted], target_seconds=target_s, step_seconds=target_s + MOE_OVERHEAD_S)
        rec.result.draft_token_ids = [[0] * k]
        ctl.observe(rec)
        plans.append(k)
        pending = k
        tokens += accepted + 1
        seconds += rec.step_seconds
    return plans, tokens / seconds


PLAIN_RATE = 1.0 / (MOE_STEP_S + MOE_OVERHEAD_S)


def test_auto_explores_when_the_prior_alone_says_no():
    """Verification rows so dear (v(1) = 1.53) that the prior acceptance (0.5) makes K = 0 optimal:
    "auto" drafts K = 1 to find out, learns that a strong draft pays and keeps drafting; a draft
    that is never accepted is retried ever more rarely, within the exploration budget."""
    strong, rate = closed_loop(moe_controller(), lambda step: 0.9, 400)
    assert 0 < strong.index(1) < 10, strong[:20]  # explored at once (after the first plain step's budget)
    assert sum(1 for k in strong[50:] if k) > 0.8 * 350, strong  # then drafts on its own estimate
    assert rate > 1.4 * PLAIN_RATE
    useless, rate = closed_loop(moe_controller(), lambda step: 0.0, 2000)
    assert 1 in useless[:10]
    assert sum(1 for k in useless[200:] if k) < 0.04 * 1800, useless  # few retries...
    assert sum(1 for k in useless[1000:] if k) >= 3  # ...but still some: the evidence ages
    assert rate > 0.975 * PLAIN_RATE  # the budget: about 2% of plain decoding (and one window's saving, once)


def test_auto_recovers_from_a_bad_patch_of_text_within_a_bounded_number_of_steps():
    """A server sees text on which the draft fails (acceptance 0 for 600 steps) and then text on which
    it is accepted 80% of the time: "auto", which stopped drafting on the first, drafts again on the
    second within a bounded number of steps (seeds 0-4), with the throughput guard in the loop."""
    switch = 600
    for seed in range(5):
        plans, _ = closed_loop(moe_controller(), lambda step: 0.0 if step < switch else 0.8, switch + 600, seed=seed)
        assert sum(1 for k in plans[switch - 200: switch] if k) <= 12, plans[switch - 200: switch]
        after = plans[switch:]
        recovered = next(i for i in range(len(after)) if sum(1 for k in after[i: i + 40] if k) >= 32)
        assert recovered <= 150, (seed, recovered, after[:300])  # 50-51 steps here


def test_steep_verification_at_acceptance_0_3_stays_at_k0():
    """At acceptance 0.3 every K loses on these costs (fixed K = 1 and 2: the negative control); "auto"
    plans K = 0 but for budgeted exploring, within 3% of plain decoding."""
    for k in (1, 2):
        assert closed_loop(moe_controller(), lambda step: 0.3, 600, fixed_k=k)[1] < 0.92 * PLAIN_RATE
    plans, rate = closed_loop(moe_controller(), lambda step: 0.3, 1500)
    # accepted drafts refund the budget, so it explores more often than at acceptance 0 (6-15% of
    # steps over seeds 0-5) for the same loss
    assert sum(1 for k in plans[300:] if k) < 0.2 * 1200, plans
    assert max(plans[300:]) <= 1  # only exploring drafts: its own plan never pays
    assert rate > 0.97 * PLAIN_RATE


def simulate_tokens_per_second(conditional, draft_s, target_s, row_s, fixed_k=None, max_k=8, steps=400, seed=0):
    """Closed loop at batch 1 on simulated costs: the real controller plans K (or ``fixed_k``), the
    drafts are proposed at the end of the step and verified in the next (the engine's order), a
    synthetic draft is accepted at position j with probability ``conditional[j]`` (the last one
    repeats), and the controller observes each step as the engine would report it."""
    rng = random.Random(seed)
    ctl = SpecController(max_k=max_k, adaptive=fixed_k is None, draft_is_model=True)
    if fixed_k is None:
        for n in (1, 2, 4, 8, 16, 32, 64):
            ctl.cost.set("target", n, target_s + row_s * (n - 1))
            ctl.cost.set("draft", n, draft_s * (1 + 0.05 * (n - 1)))
    req = decoding("r", 100_000, 10)
    seconds = tokens = pending = 0
    for _ in range(steps):
        k = ks(ctl, [req])[0] if fixed_k is None else fixed_k
        accepted = 0  # the drafts planned last step, proposed at its end, are verified now
        while accepted < pending and rng.random() < conditional[min(accepted, len(conditional) - 1)]:
            accepted += 1
        step = record(["r"], [pending], [accepted], target_seconds=target_s + row_s * pending,
                      step_seconds=k * draft_s + target_s + row_s * pending)
        step.result.draft_seconds, step.result.num_draft_passes = k * draft_s, k
        step.result.draft_token_ids = [[0] * k]
        if fixed_k is None:
            ctl.observe(step)
        seconds += step.step_seconds
        tokens += accepted + 1
        pending = k
    return tokens / seconds


@pytest.mark.parametrize("case, conditional, draft_s, floor", [
    # a 0.5B draft of a 1.5B target on code: deeper positions accepted more often than the first
    ("strong, rising with depth", [0.89, 0.93, 0.95, 0.95, 0.96], 0.038, 0.97),
    ("i.i.d. 0.8", [0.8], 0.038, 0.97),
    ("drifting", [0.8, 0.7, 0.6, 0.5, 0.4], 0.038, 0.97),
    ("cheap head, i.i.d. 0.7", [0.7], 0.005, 0.97),
    # best fixed K = 0: "auto" pays for its exploring (K = 1 now and then, within ~2% of plain time)
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
