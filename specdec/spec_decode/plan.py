"""The speculation policy's decision for one step, as data: what the scheduler grants and
what the worker's tree drafting needs. Picklable (no tensors): it reaches workers inside
``SchedulerOutput``."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class TreeBudget:
    """Adaptive token trees: the price of verification rows this step, so the worker can keep
    the drafted nodes that pay for themselves (``adaptive.choose_num_tree_nodes``)."""
    num_base_rows: int  # rows of the step without drafts: decode rows and prefill chunks
    calibration: float  # realised / predicted accepted tokens of recent trees (scales the gains)
    target_seconds: np.ndarray  # [max_nodes + 1] float64: a target pass over num_base_rows + n rows

    def costs(self, kind: str, num_tokens: np.ndarray) -> np.ndarray:
        """``StepCostModel.costs`` for the target, read off this step's table."""
        if kind != "target":
            raise ValueError(f"a tree budget prices target rows only, not {kind!r}")
        offset = np.asarray(num_tokens, dtype=np.int64) - self.num_base_rows
        return self.target_seconds[np.clip(offset, 0, self.target_seconds.shape[0] - 1)]

    def choose_num_nodes(self, gains: list[list[float]], draft_seconds: float) -> list[int]:
        """Per request, how many of its drafted nodes to verify (``gains[i]``: the draft's
        probability of each node's path, best first)."""
        from specdec.spec_decode.adaptive import choose_num_tree_nodes

        scaled = [[g * self.calibration for g in gs] for gs in gains]
        return choose_num_tree_nodes(scaled, self.num_base_rows, self, draft_seconds)


@dataclass
class SpeculationPlan:
    """Per running request, the draft tokens the worker may propose for it at the end of this
    step, to be verified in the next (absent or 0: none) and, for adaptive trees, the tree depth
    planned. A request absent from ``num_spec_tokens`` whose prompt this step completes (a new
    one) gets ``new_request_spec_tokens``."""
    num_spec_tokens: dict[str, int] = field(default_factory=dict)
    tree_depths: dict[str, int] = field(default_factory=dict)
    tree_budget: TreeBudget | None = None
    new_request_spec_tokens: int = 0
