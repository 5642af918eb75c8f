"""Phi-3 / Phi-4-mini (``Phi3ForCausalLM``): the Llama decoder, partial rotary when the config
sets ``partial_rotary_factor``, and LongRoPE. The checkpoint's fused ``qkv_proj`` / ``gate_up_proj``
are cut into their q, k, v / gate, up parts as they are read, so they load (and shard under
tensor parallelism: each rank keeps its heads' rows of each part) like every other family's.

LongRoPE follows transformers: a request whose sequence is longer than
``original_max_position_embeddings`` rotates with the long factors, otherwise with the short
ones, both tables scaled by the attention factor. The choice is made per row (on the device, so
captured graphs make it too): long from the switch position on, and for every row of a step that
feeds a request from position 0 past the switch (a long prompt prefilled in one chunk). A row's
choice so depends on its position, not on the step's other rows: a verification row rotates as
its one-row decode step does, drafts or not. transformers re-encodes a sequence whose generation
crosses the switch point; here the keys cached before the crossing keep the short factors (as
vLLM does), so such a request matches transformers only up to the crossing.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from specdec.layers.attention import AttentionBackend, AttentionMetadata
from specdec.models.llama import DecoderLayer, LlamaForCausalLM


def _partial_rotary_factor(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    return float(factor or 1.0)


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._unfused(weights))

    def _unfused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        config = self.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        q_size = config.num_attention_heads * head_dim
        kv_size = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * head_dim
        split = getattr(self, "tensor_parallel_split", None)  # this rank's rows of each part
        for name, tensor in weights:
            if ".qkv_proj." in name:
                parts = zip(("q_proj", "k_proj", "v_proj"), ("q", "kv", "kv"), tensor.split([q_size, kv_size, kv_size]))
            elif ".gate_up_proj." in name:
                parts = zip(("gate_proj", "up_proj"), ("mlp", "mlp"), tensor.chunk(2, dim=0))
            else:
                yield name, tensor
                continue
            fused = "qkv_proj" if ".qkv_proj." in name else "gate_up_proj"
            for part, kind, value in parts:
                if split is not None:
                    start, end = split.rows(kind)
                    value = value[start:end]
                yield name.replace(f".{fused}.", f".{part}."), value

    def make_layer(self, config, layer_idx: int, qkv_bias: bool, attn_backend: AttentionBackend) -> nn.Module:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rotary_dim = int(head_dim * _partial_rotary_factor(config))
        return DecoderLayer(config, qkv_bias, False, attn_backend, rotary_dim=rotary_dim,
                            **self.attention_options(config, layer_idx))

    @property
    def rotary_dim(self) -> int:
        return self.layers[0].self_attn.rotary_dim

    def rope_rows(self, positions: torch.Tensor, meta: AttentionMetadata):
        switch = self.rotary.original_max_position
        if switch is None:
            return self.rotary.lookup(positions)
        rows = torch.arange(positions.shape[0], device=positions.device)
        qsl = meta.query_start_loc
        request = torch.searchsorted(qsl[1:], rows, right=True).clamp_(max=meta.num_reqs - 1)
        whole = (meta.seq_lens == qsl[1:] - qsl[:-1]) & (meta.seq_lens > switch)  # [R] prefilled from 0 past it
        return self.rotary.lookup(positions, long_rows=(positions >= switch) | whole[request])

