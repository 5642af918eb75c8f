"""Mistral: the Llama decoder, every layer sliding when the config sets ``sliding_window``."""
from specdec.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
