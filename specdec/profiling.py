"""Named ranges for ``torch.profiler`` around the parts of a step (``specdec bench profile``
groups operator time by them). Free when no profiler runs: one flag read."""
from __future__ import annotations

import contextlib

import torch

RANGE_PREFIX = "specdec::"
_NO_RANGE = contextlib.nullcontext()


def profile_range(label: str):
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(RANGE_PREFIX + label)
    return _NO_RANGE
