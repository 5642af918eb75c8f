"""LoRAManager (worker side): which adapter sits in which of the ``max_loras`` slots.

``activate`` gives each request of a step its slot, loading the adapters the step needs
that are not resident into free slots or, failing that, the least recently used slots no
request of this step needs. The scheduler never runs more than ``max_loras`` distinct
adapters in one step, so a slot is always found. Adapters were validated by the engine
(``LoRARegistry``) before their requests were queued.
"""
from __future__ import annotations

from collections import OrderedDict

from specdec.layers.lora import NO_ADAPTER, LoRALayers
from specdec.lora.adapter import load_adapter
from specdec.lora.request import LoRARequest


class LoRAManager:
    def __init__(self, layers: LoRALayers, model_config, max_lora_rank: int):
        self.layers = layers
        self.model_config = model_config
        self.max_lora_rank = max_lora_rank
        self.resident: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self.free_slots = list(range(layers.max_loras))
        self.num_loads = 0

    def activate(self, lora_requests: list[LoRARequest | None]) -> list[int]:
        """Per request, its adapter's slot (``NO_ADAPTER`` for the base model)."""
        wanted = list(dict.fromkeys(r.lora_int_id for r in lora_requests if r is not None))
        if len(wanted) > self.layers.max_loras:
            raise RuntimeError(f"a step needs {len(wanted)} adapters, over max_loras {self.layers.max_loras}")
        by_id = {r.lora_int_id: r for r in lora_requests if r is not None}
        for adapter_id in wanted:
            if adapter_id not in self.resident:
                self._load(by_id[adapter_id], set(wanted))
            self.resident.move_to_end(adapter_id)
        return [NO_ADAPTER if r is None else self.resident[r.lora_int_id] for r in lora_requests]

    def _load(self, request: LoRARequest, keep: set[int]) -> None:
        if self.free_slots:
            slot = self.free_slots.pop(0)
        else:
            victim = next(i for i in self.resident if i not in keep)
            slot = self.resident.pop(victim)
        adapter = load_adapter(request, self.model_config, self.max_lora_rank)
        self.layers.set_slot(slot, adapter.weights)
        self.resident[request.lora_int_id] = slot
        self.num_loads += 1

    def remove(self, adapter_id: int) -> None:
        """Forget an adapter (unloaded by the server): its slot is free for the next one."""
        slot = self.resident.pop(adapter_id, None)
        if slot is not None:
            self.layers.set_slot(slot, {})
            self.free_slots.append(slot)
