"""Tensor parallelism as module transforms (gpt-fast's ``tp.py`` idea): model code has no TP
branches. Megatron's split, for the Llama family (Llama, Mistral, Qwen2, Qwen3):

- column-parallel ``qkv_proj`` (this rank's query heads and KV heads) and ``gate_up_proj``
  (this rank's slice of the intermediate size): no communication;
- row-parallel ``o_proj`` and ``down_proj``: a partial product, one all-reduce each, the bias
  added once after it;
- vocabulary-parallel embedding (rows outside this rank's slice read as zeros, one
  all-reduce) and LM head (this rank's logits, one all-gather along the vocabulary);
- attention heads and so the paged KV cache split across ranks; with fewer KV heads than
  ranks (GQA) each rank keeps the one KV head its query heads read (replicated).
- mixture-of-experts layers (``layers.moe.SparseMoE``): every expert's intermediate dimension
  split like the dense MLP's (gate/up column-parallel, down row-parallel), the router
  replicated, and one all-reduce per layer after the weighted sum of the experts. Splitting
  each expert rather than giving each rank whole experts keeps the ranks equally loaded
  whatever the routing: a decode or verification step has few rows, which touch a handful of
  experts, and under expert placement the rank owning most of them would set the step's time
  while the others wait. Every rank routes identically (replicated router, same input), so all
  run the same experts in the same order and the single reduction adds matching partials.
  gpt-oss's stacked expert tensors are cut the same way (interleaved gate/up rows in pairs,
  MXFP4 blocks whole: each rank's width a multiple of 32); its expert output biases stay on
  rank 0 (zeros elsewhere) so the reduction adds them once; attention sinks split by head.

Two phases around loading: ``shard_shapes`` resizes the meta-device model to one rank's
shapes before any memory is allocated; ``ShardSlicer`` cuts each checkpoint tensor to this
rank's slice while it is read (safetensors slices are mmapped, so a rank reads only its own
bytes); ``wrap_collectives`` then puts the communication around the loaded modules.
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from specdec.distributed.parallel_state import TensorParallelGroup
from specdec.layers.moe import SparseMoE
from specdec.layers.mxfp4 import Mxfp4Linear


def _check_divides(world: int, what: str, count: int) -> None:
    if count % world:
        raise ValueError(f"tensor_parallel_size {world} does not divide the model's {what} ({count})")


class _Split:
    """This rank's share of a model's dimensions."""

    def __init__(self, config, world: int, rank: int):
        self.world, self.rank = world, rank
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.intermediate = config.intermediate_size
        # experts' width: Qwen3-MoE names it apart from the dense layers'; Mixtral shares it
        self.expert_intermediate = getattr(config, "moe_intermediate_size", None) or self.intermediate
        self.vocab = config.vocab_size
        _check_divides(world, "attention heads", self.heads)
        if self.kv_heads >= world:
            _check_divides(world, "KV heads", self.kv_heads)
        _check_divides(world, "intermediate size", self.intermediate)
        _check_divides(world, "expert intermediate size", self.expert_intermediate)
        _check_divides(world, "vocabulary", self.vocab)
        self.local_heads = self.heads // world
        self.local_kv_heads = max(1, self.kv_heads // world)
        self.local_intermediate = self.intermediate // world
        self.local_expert_intermediate = self.expert_intermediate // world
        self.local_vocab = self.vocab // world
        # a family's own (name pattern, (start, end), dim) slices, tried before the table below
        self.rules: list[tuple[re.Pattern, tuple[int, int], int]] = []

    def kv_head_range(self) -> tuple[int, int]:
        if self.kv_heads >= self.world:
            return self.rank * self.local_kv_heads, (self.rank + 1) * self.local_kv_heads
        first = self.rank * self.kv_heads // self.world  # the KV head this rank's query heads share
        return first, first + 1

    def rows(self, kind: str) -> tuple[int, int]:
        """This rank's [start, end) along the split dimension of a weight of ``kind``."""
        r, d = self.rank, self.head_dim
        if kind == "q":
            return r * self.local_heads * d, (r + 1) * self.local_heads * d
        if kind == "kv":
            first, last = self.kv_head_range()
            return first * d, last * d
        if kind == "mlp":
            return r * self.local_intermediate, (r + 1) * self.local_intermediate
        if kind == "expert":
            return r * self.local_expert_intermediate, (r + 1) * self.local_expert_intermediate
        if kind == "expert_pairs":  # gpt-oss's gate_up rows interleave gate and up: two rows per column
            return 2 * r * self.local_expert_intermediate, 2 * (r + 1) * self.local_expert_intermediate
        if kind == "expert_blocks":  # MXFP4 blocks of 32 inputs
            return r * self.local_expert_intermediate // 32, (r + 1) * self.local_expert_intermediate // 32
        if kind == "heads":
            return r * self.local_heads, (r + 1) * self.local_heads
        if kind == "vocab":
            return r * self.local_vocab, (r + 1) * self.local_vocab
        raise ValueError(kind)


def _linear_like(linear: nn.Linear, in_features: int, out_features: int) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=linear.bias is not None,
                     device=linear.weight.device, dtype=linear.weight.dtype)


def shard_shapes(model: nn.Module, tp: TensorParallelGroup) -> None:
    """Resize a (meta-device) model to this rank's shapes, in place: the Llama-family split, or
    the family's own (``shard_layers_for_tensor_parallel(split)``, e.g. DeepSeek's latent
    attention, which also adds its checkpoint slicing rules to ``split.rules``)."""
    split = _Split(model.config, tp.world_size, tp.rank)
    own_split = getattr(model, "shard_layers_for_tensor_parallel", None)
    if own_split is not None:
        own_split(split)
    else:
        _shard_llama_layers(model, split)
    hidden = model.config.hidden_size
    embed = model.embed_tokens
    model.embed_tokens = nn.Embedding(split.local_vocab, hidden, device=embed.weight.device, dtype=embed.weight.dtype)
    model.lm_head = _linear_like(model.lm_head, hidden, split.local_vocab)
    model.tensor_parallel_split = split


def _shard_llama_layers(model: nn.Module, split: _Split) -> None:
    attn_kind = type(model.layers[0].self_attn)
    if not hasattr(model.layers[0].self_attn, "qkv_proj"):
        raise ValueError(f"{type(model).__name__} cannot run with tensor_parallel_size > 1 yet: its attention "
                         f"({attn_kind.__name__}) has no head-sharded form")
    hidden = model.config.hidden_size
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.num_heads, attn.num_kv_heads = split.local_heads, split.local_kv_heads
        attn.q_size, attn.kv_size = split.local_heads * split.head_dim, split.local_kv_heads * split.head_dim
        attn.qkv_proj = _linear_like(attn.qkv_proj, hidden, attn.q_size + 2 * attn.kv_size)
        attn.o_proj = _linear_like(attn.o_proj, attn.q_size, hidden)
        if getattr(attn, "sinks", None) is not None:  # one logit per query head
            attn.sinks = nn.Parameter(torch.empty(split.local_heads, device=attn.sinks.device, dtype=attn.sinks.dtype))
        if isinstance(mlp, SparseMoE):
            for expert in mlp.experts:
                _shard_feed_forward(expert, hidden, split.local_expert_intermediate)
        else:
            _shard_feed_forward(mlp, hidden, split.local_intermediate)


def _shard_feed_forward(mlp: nn.Module, hidden: int, local_intermediate: int) -> None:
    mlp.intermediate_size = local_intermediate
    if isinstance(mlp.gate_up_proj, Mxfp4Linear):
        if local_intermediate % 32:
            raise ValueError(f"tensor parallelism would cut MXFP4 blocks: each rank's expert width "
                             f"({local_intermediate}) must be a multiple of 32")
        with torch.device(mlp.gate_up_proj.blocks.device):
            mlp.gate_up_proj = Mxfp4Linear.empty(hidden, 2 * local_intermediate, mlp.gate_up_proj.bias is not None)
            mlp.down_proj = Mxfp4Linear.empty(local_intermediate, hidden, mlp.down_proj.bias is not None)
        return
    mlp.gate_up_proj = _linear_like(mlp.gate_up_proj, hidden, 2 * local_intermediate)
    mlp.down_proj = _linear_like(mlp.down_proj, local_intermediate, hidden)


# checkpoint name -> (split kind, dimension it is split along); experts (Mixtral's w1 / w3 / w2
# too) before the dense MLP's names, which they also match
_SLICED = (
    (re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|w1|w3)\.weight$"), "expert", 0),
    (re.compile(r"\.experts\.\d+\.(down_proj|w2)\.weight$"), "expert", 1),
    # gpt-oss: experts stacked [E, ...]; float weights stored [E, in, out]
    (re.compile(r"\.experts\.gate_up_proj(_blocks|_scales|_bias)$"), "expert_pairs", 1),
    (re.compile(r"\.experts\.gate_up_proj$"), "expert_pairs", 2),
    (re.compile(r"\.experts\.down_proj(_blocks|_scales)$"), "expert_blocks", 2),
    (re.compile(r"\.experts\.down_proj$"), "expert", 1),
    (re.compile(r"\.self_attn\.sinks$"), "heads", 0),
    (re.compile(r"\.q_proj\.(weight|bias)$"), "q", 0),
    (re.compile(r"\.[kv]_proj\.(weight|bias)$"), "kv", 0),
    (re.compile(r"\.o_proj\.weight$"), "q", 1),
    (re.compile(r"\.(gate|up)_proj\.(weight|bias)$"), "mlp", 0),
    (re.compile(r"\.down_proj\.weight$"), "mlp", 1),
    (re.compile(r"(^|\.)embed_tokens\.weight$"), "vocab", 0),
    (re.compile(r"(^|\.)lm_head\.weight$"), "vocab", 0),
)


class ShardSlicer:
    """Cuts checkpoint tensors to a rank's slice while they are read."""

    def __init__(self, split: _Split):
        self.split = split

    def read(self, name: str, safetensors_slice) -> torch.Tensor:
        for pattern, (start, end), dim in self.split.rules:
            if pattern.search(name):
                return safetensors_slice[(slice(None),) * dim + (slice(start, end),)]
        for pattern, kind, dim in _SLICED:
            if pattern.search(name):
                start, end = self.split.rows(kind)
                return safetensors_slice[(slice(None),) * dim + (slice(start, end),)]
        if name.endswith(".experts.down_proj_bias") and self.split.rank:
            # an expert's output bias, scaled by its routing weight inside the layer, is added
            # before the layer's one reduction: rank 0 alone holds it
            return torch.zeros_like(safetensors_slice[:])
        return safetensors_slice[:]  # replicated: norms, o/down biases


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local W_local^T) + b: each rank holds the input columns of its heads."""

    def __init__(self, linear: nn.Linear, tp: TensorParallelGroup):
        super().__init__()
        self.bias = linear.bias
        linear.bias = None  # added once, after the reduction
        self.linear = linear
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(self.linear(x))
        return out if self.bias is None else out + self.bias


class RowParallelMoE(nn.Module):
    """y = all_reduce(sum of this rank's expert partials): one reduction per MoE layer (shared
    experts, as DeepSeek's, included: their partials join the same sum)."""

    def __init__(self, moe: nn.Module, tp: TensorParallelGroup):
        super().__init__()
        self.moe = moe
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.moe(x))


class VocabParallelEmbedding(nn.Module):
    def __init__(self, embedding: nn.Embedding, tp: TensorParallelGroup, start: int):
        super().__init__()
        self.weight = embedding.weight  # [V / N, H]
        self.start = start
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside[:, None], 0))


class VocabParallelLMHead(nn.Module):
    def __init__(self, linear: nn.Linear, tp: TensorParallelGroup, start: int):
        super().__init__()
        self.linear = linear  # [V / N, H] rows of this rank
        self.start = start
        self.tp = tp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V]
        return self.tp.all_gather_last_dim(self.linear(hidden))

    def weight_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[n, H]: the full LM-head rows of ``token_ids`` on every rank (each rank fills its own)."""
        weight = self.linear.weight.detach()
        local = token_ids - self.start
        inside = (local >= 0) & (local < weight.shape[0])
        rows = torch.zeros(token_ids.shape[0], weight.shape[1], dtype=weight.dtype, device=weight.device)
        rows[inside] = weight[local[inside]]
        return self.tp.all_reduce(rows)


def wrap_collectives(model: nn.Module, tp: TensorParallelGroup) -> None:
    """Put the all-reduces / all-gathers around a loaded, sharded model (before packing)."""
    split = model.tensor_parallel_split
    for layer in model.layers:
        layer.self_attn.o_proj = RowParallelLinear(layer.self_attn.o_proj, tp)
        if not hasattr(layer.mlp, "down_proj"):  # a mixture of experts: one reduction after the sum
            layer.mlp = RowParallelMoE(layer.mlp, tp)
        else:
            layer.mlp.down_proj = RowParallelLinear(layer.mlp.down_proj, tp)
    start = split.rows("vocab")[0]
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, tp, start)
    model.lm_head = VocabParallelLMHead(model.lm_head, tp, start)
