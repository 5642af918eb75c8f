"""The public record of one engine step: what the speculation policy, the metrics and the
benchmarks learn from (``EngineCore.add_step_observer``), instead of patching the engine."""
from __future__ import annotations

from dataclasses import dataclass

from specdec.engine.scheduler_output import SchedulerOutput
from specdec.worker.model_runner_output import ModelRunnerOutput


@dataclass
class StepRecord:
    scheduled: SchedulerOutput
    result: ModelRunnerOutput
    num_emitted_tokens: list[int]  # per request: tokens committed (a stop may cut a run short)
    step_seconds: float  # the whole step, planning and commit included

    @property
    def total_emitted_tokens(self) -> int:
        return sum(self.num_emitted_tokens)

    def drafts(self):
        """(request id, drafts verified, positions drafted, drafts accepted) per request that drafted."""
        r = self.result
        for rid, n, pos, acc in zip(r.request_ids, r.num_draft_tokens, r.num_draft_positions, r.num_accepted_tokens):
            if n:
                yield rid, n, pos, acc
