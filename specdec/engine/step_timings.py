"""Where the engine's time goes, by step phase: a step observer that sums each step's seconds
into the target's forward, the proposer (drafting the next step), sampling/verification and the
rest (planning, scheduling, building inputs, committing tokens with their stop checks).

A step is a *prefill* step when it computes prompt tokens for some request (a prompt chunk, a
prompt's first token, a preempted request's recomputation), else a *decode* step. At batch 1
the prefill step of a speculative request holds the target's prompt forward and, under
``draft``, the draft model's pass over the same prompt plus its first K proposals; the decode
steps hold the verifications. Counters only grow, so a client that runs one request at a time
reads one request's split as the difference of two snapshots (``specdec bench serve-peers``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specdec.engine.step_record import StepRecord

PHASES = ("prefill", "decode")
PARTS = ("target", "draft", "sampling", "other")


@dataclass
class PhaseTimings:
    num_steps: int = 0
    num_tokens: int = 0  # target rows scheduled (prompt tokens, newest tokens, drafts verified)
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))

    def as_dict(self) -> dict:
        return {"num_steps": self.num_steps, "num_tokens": self.num_tokens, "seconds": dict(self.seconds)}


@dataclass
class StepTimings:
    phases: dict[str, PhaseTimings] = field(default_factory=lambda: {p: PhaseTimings() for p in PHASES})

    @staticmethod
    def phase_of(record: StepRecord) -> str:
        sched = record.scheduled
        prefill = any(n > 1 or out == 0 for n, out in zip(sched.num_scheduled_tokens, sched.num_output_tokens))
        return "prefill" if prefill else "decode"

    def observe(self, record: StepRecord) -> None:
        r = record.result
        phase = self.phases[self.phase_of(record)]
        phase.num_steps += 1
        phase.num_tokens += record.scheduled.total_num_tokens
        s = phase.seconds
        s["target"] += r.target_seconds
        s["draft"] += r.draft_seconds
        s["sampling"] += r.sampling_seconds
        # the step's wall time not spent in the three above (never negative: clocks are per part)
        s["other"] += max(0.0, record.step_seconds - r.target_seconds - r.draft_seconds - r.sampling_seconds)

    def as_dict(self) -> dict:
        return {name: p.as_dict() for name, p in self.phases.items()}
