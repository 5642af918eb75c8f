"""Mistral: the Llama decoder (sliding window is handled by capping max_model_len at load)."""
from specdec.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
