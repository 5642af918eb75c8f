"""StepTimings: each step's seconds land in its phase (prefill: the step computes prompt tokens)
and its parts; "other" is the step's wall time outside the worker's three timed parts."""
import pytest

from specdec.engine.scheduler_output import SchedulerOutput
from specdec.engine.step_record import StepRecord
from specdec.engine.step_timings import StepTimings
from specdec.worker.model_runner_output import ModelRunnerOutput


def _record(scheduled: list[int], num_output: list[int], drafts: list[list[int]], step_s: float,
            target_s: float, draft_s: float, sampling_s: float) -> StepRecord:
    ids = [f"r{i}" for i in range(len(scheduled))]
    sched = SchedulerOutput(request_ids=ids, num_scheduled_tokens=scheduled, num_output_tokens=num_output,
                            spec_token_ids=drafts)
    result = ModelRunnerOutput(request_ids=ids, target_seconds=target_s, draft_seconds=draft_s,
                               sampling_seconds=sampling_s)
    return StepRecord(sched, result, [1] * len(ids), step_s)


def test_steps_are_split_by_phase_and_part():
    t = StepTimings()
    t.observe(_record([120], [0], [[]], 0.5, 0.3, 0.12, 0.01))  # a prompt, its first token and first drafts
    t.observe(_record([1], [1], [[5, 6, 7]], 0.1, 0.06, 0.03, 0.005))  # a verification of 3 drafts
    t.observe(_record([1], [4], [[8]], 0.1, 0.05, 0.02, 0.004))
    t.observe(_record([1, 30], [7, 0], [[9], []], 0.4, 0.2, 0.1, 0.01))  # a new prompt joins a decoding request
    got = t.as_dict()
    assert got["prefill"]["num_steps"] == 2 and got["decode"]["num_steps"] == 2
    assert got["prefill"]["num_tokens"] == 120 + 32 and got["decode"]["num_tokens"] == 4 + 2
    assert got["prefill"]["seconds"]["target"] == pytest.approx(0.5)
    assert got["prefill"]["seconds"]["draft"] == pytest.approx(0.22)
    assert got["decode"]["seconds"]["other"] == pytest.approx(0.1 - 0.095 + 0.1 - 0.074)
    # the parts add up to the steps' wall time
    assert sum(got["prefill"]["seconds"].values()) == pytest.approx(0.5 + 0.4)
    assert sum(got["decode"]["seconds"].values()) == pytest.approx(0.1 + 0.1)


def test_a_one_token_prompt_is_a_prefill_step():
    assert StepTimings.phase_of(_record([1], [0], [[]], 0.1, 0.05, 0.0, 0.0)) == "prefill"
    assert StepTimings.phase_of(_record([1], [3], [[]], 0.1, 0.05, 0.0, 0.0)) == "decode"
