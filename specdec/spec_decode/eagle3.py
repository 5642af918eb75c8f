"""EAGLE-3 proposer: the EAGLE proposer's passes (``eagle.py``) over an EAGLE-3 head
(``models/eagle3.py``). The target's runner exports the inputs of the head's auxiliary layers
[T, n * H_t] instead of its final hidden states; the rows the head catches up on are projected
through the head's ``fc`` once, so what the head is fed is [rows, H] as for EAGLE. The head's logits cover its draft vocabulary only (-inf elsewhere), so drafts never leave it.
"""
from __future__ import annotations

import torch

from specdec.spec_decode.eagle import EagleProposer


class Eagle3Proposer(EagleProposer):
    name = "eagle3"

    @torch.inference_mode()
    def _target_features(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.runner.model.combine(hidden)  # [T, n * H_t] -> [T, H]
