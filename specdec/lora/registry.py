"""LoRARegistry (engine side): adapters validated before any of their requests is queued.

A request's adapter is read and checked against the model here (``load_adapter``) the first
time its id is seen, so a bad adapter is a ``ValueError`` for that request, never a failed
step. An id stays bound to the name and path it was first seen with.
"""
from __future__ import annotations

import threading

from specdec.lora.adapter import load_adapter
from specdec.lora.request import LoRARequest


class LoRARegistry:
    def __init__(self, model_config, max_lora_rank: int):
        self.model_config = model_config
        self.max_lora_rank = max_lora_rank
        self.known: dict[int, LoRARequest] = {}  # adapter id -> the request that introduced it
        self._lock = threading.Lock()  # a server validates on its tokenizer threads
        self._max_id = 0  # the largest id handed out or seen

    def new_id(self) -> int:
        """An adapter id no request has used (a server names adapters; ids are never reused)."""
        with self._lock:
            self._max_id += 1
            return self._max_id

    def validate(self, request: LoRARequest) -> None:
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest or None, got {type(request).__name__}")
        with self._lock:
            seen = self.known.get(request.lora_int_id)
        if seen is not None:
            if (seen.lora_name, seen.lora_path) != (request.lora_name, request.lora_path):
                raise ValueError(f"lora_int_id {request.lora_int_id} already names adapter {seen.lora_name!r} "
                                 f"({seen.lora_path}); give {request.lora_name!r} its own lora_int_id")
            return
        load_adapter(request, self.model_config, self.max_lora_rank)  # raises naming the problem
        with self._lock:
            self.known.setdefault(request.lora_int_id, request)
            self._max_id = max(self._max_id, request.lora_int_id)

    def forget(self, adapter_id: int) -> None:
        with self._lock:
            self.known.pop(adapter_id, None)
