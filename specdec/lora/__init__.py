"""LoRA adapters (vLLM's names): requests, PEFT checkpoints, the slot manager."""
from specdec.lora.request import LoRARequest

__all__ = ["LoRARequest"]
