"""SharedWeights: one copy of a target's weights for several engines in one process.

    weights = SharedWeights()
    plain = LLM(model=path, target_weights=weights)  # loads the target and leaves it in ``weights``
    ngram = LLM(model=path, target_weights=weights, speculative_config={"method": "ngram"})  # reuses it

Benchmarks comparing proposers run every engine on the same weights this way: engines with their
own copies differ in speed by where each copy's pages landed. An engine whose plan loads the
target differently (another dtype, quantization or device) refuses the held weights instead of
running on them. One device only (``tensor_parallel_size`` 1).
"""
from __future__ import annotations

from typing import Hashable

from torch import nn


class SharedWeights:
    def __init__(self):
        self._key: Hashable | None = None
        self._model: nn.Module | None = None

    @property
    def model(self) -> nn.Module | None:
        """The target as loaded and prepared (packed, quantized) by the first engine; None before."""
        return self._model

    def take(self, key: Hashable) -> nn.Module | None:
        """The held target for an engine whose plan says ``key`` (model path, device, weight plan);
        None when nothing is held yet. Raises if the held weights were loaded for another plan."""
        if self._model is None:
            return None
        if key != self._key:
            raise ValueError(f"target_weights holds weights loaded as {self._key}; this engine needs {key} "
                             f"(give it the same model, dtype, quantization and device, or its own weights)")
        return self._model

    def hold(self, key: Hashable, model: nn.Module) -> None:
        if self._model is not None:
            raise ValueError("target_weights already holds a target")
        self._key, self._model = key, model
