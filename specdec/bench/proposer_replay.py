"""Teacher-forced replay of recorded (prompt, output) pairs through a draft-free proposer
(n-gram, suffix): the acceptance a proposer would reach on a workload, without a model."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class SimulationStats:
    num_steps: int = 0
    num_proposed_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def mean_accepted_per_step(self) -> float:
        return self.num_accepted_tokens / max(self.num_steps, 1)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / max(self.num_proposed_tokens, 1)


def simulate(proposer, sequences: Sequence[tuple[Sequence[int], Sequence[int]]], k: int) -> SimulationStats:
    """Teacher-forced replay of (prompt, output) pairs, in order, through ``proposer``: at
    each step propose ``k`` tokens for prompt + output[:t], accept the prefix that equals
    output[t:], advance t by accepted + 1 (the target's own token). Each request is then
    reported finished so stores can learn. Deterministic."""
    stats = SimulationStats()
    for index, (prompt, output) in enumerate(sequences):
        request_id = f"simulated-{index}"
        full = np.asarray(list(prompt) + list(output), dtype=np.int64)
        num_prompt, num_output = len(prompt), len(output)
        t = 0
        while t < num_output:
            draft = proposer.propose([full[: num_prompt + t]], [k], [request_id])[0]
            truth = full[num_prompt + t : num_prompt + t + len(draft)]
            mismatch = np.flatnonzero(np.asarray(draft[: truth.shape[0]], dtype=np.int64) != truth)
            num_accepted = int(mismatch[0]) if mismatch.size else truth.shape[0]
            stats.num_steps += 1
            stats.num_proposed_tokens += len(draft)
            stats.num_accepted_tokens += num_accepted
            t += num_accepted + 1
        proposer.on_request_finished(request_id, full.tolist(), num_prompt_tokens=num_prompt)
    return stats


def simulate_acceptance(proposer, sequences: Sequence[tuple[Sequence[int], Sequence[int]]], k: int) -> float:
    """Mean accepted draft tokens per step (tokens per step = this + 1); see ``simulate``."""
    return simulate(proposer, sequences, k).mean_accepted_per_step
