"""SpecController: "auto" K from the cost model, acceptance estimates, the guard and the queue."""
from specdec.engine.request import Request
from specdec.sampling_params import SamplingParams
from specdec.spec.controller import SpecController


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
            ctl.observe_acceptance(decoding(rid, 10, 0), 4, 3)  # acceptance ~0.75
    return ctl


def test_a_closed_batch_keeps_drafts_for_the_request_that_ends_it():
    lead, lag = decoding("lead", 256, 240), decoding("lag", 256, 40)  # 16 vs 216 tokens to go
    ctl = controller()
    ks = [ctl.num_tokens_for(r, [lead, lag], closed_batch=True) for r in (lead, lag)]
    assert ks[0] == 0 and ks[1] > 0
    # open to new requests (a server, or a queue waiting): finishing the leader early frees a slot
    ctl = controller()
    ks = [ctl.num_tokens_for(r, [lead, lag], closed_batch=False) for r in (lead, lag)]
    assert ks[0] > 0 and ks[1] > 0


def test_remaining_budget_is_capped_by_the_context():
    unbounded = Request("u", [1, 2, 3], SamplingParams(max_tokens=None))
    assert controller(max_model_len=100).remaining_budget(unbounded) == 97
    assert controller(max_model_len=100).remaining_budget(decoding("b", 20, 5)) == 15


def test_equal_budgets_plan_as_before():
    a, b = decoding("lead", 256, 40), decoding("lag", 256, 40)
    ctl = controller()
    alone = [ctl.num_tokens_for(r, [a, b], closed_batch=True) for r in (a, b)]
    ctl = controller()
    queued = [ctl.num_tokens_for(r, [a, b], closed_batch=False) for r in (a, b)]
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
        assert ctl.num_tokens_for(a, [a, b]) == 0
        ctl._plan = {}  # what observe_step does after each step
    assert len(calls) == 2  # planned, reused 4 times, planned again
    for _ in range(26):  # each plan that again drafts nothing doubles the reuse: 4, 8, 16 (cap 32)
        assert ctl.num_tokens_for(a, [a, b]) == 0
        ctl._plan = {}
    assert len(calls) == 4  # steps 0, 5, 14, 31
    ctl.observe_acceptance(a, 2, 2)  # new evidence: plan afresh, and every 5th step again
    for _ in range(6):
        ctl.num_tokens_for(a, [a, b])
        ctl._plan = {}
    assert len(calls) == 6


def test_the_cost_model_is_fed_the_rows_the_target_ran_not_the_slots_reserved():
    from specdec.engine.scheduler import SchedulerOutput
    from specdec.spec.proposer import DraftProposal

    reqs = [decoding(f"r{i}", 256, 10) for i in range(4)]
    ctl = controller()
    seen = []
    ctl.cost.observe = lambda kind, num_tokens, seconds: seen.append((kind, num_tokens))
    # K = 4 reserved for each of 4 requests (20 rows), but the proposer found drafts for one only
    sched = SchedulerOutput(reqs, [1] * 4, [4] * 4)
    ctl.observe_step(sched, DraftProposal([[5, 6], [], [], []], None), 0.0, 0.01)
    assert seen == [("target", 6)]
