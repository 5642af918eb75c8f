"""Mixture-of-experts feed-forward, executed grouped by expert.

``SparseMoE(x [T, H])``: a ``TopKRouter`` picks ``top_k`` experts per row with their routing
weights, then ``grouped_experts`` sorts the step's (row, expert) pairs by expert and runs each
touched expert once on all the rows that chose it, scattering the outputs back (``index_add_``)
scaled by their weights. A K+1-row verification therefore reads the union of the experts its
rows chose, not (K+1) x top_k experts: the per-step count is kept in ``SparseMoE.stats`` (and
summed over a model by ``experts_read``) for the cost model and benchmarks to read.

Each expert is an ``Expert`` with two ordinary linears (``gate_up_proj`` [2I, H] with the gate
half first, ``down_proj`` [H, I]), so the module transforms that act on ``nn.Linear`` (int8 /
int4 / w4a8 / bf16 weights in ``layers.quantization``, tensor-parallel sharding) apply to every
expert unchanged. The router is not an ``nn.Linear`` on purpose: it stays in the model's dtype
under quantization, as vLLM and llama.cpp keep it, because its weights are few and a rounded
router changes which experts run.

``reference_moe`` is the pure-torch reference: every (row, choice) pair computed on its own.
On GPUs ``fuse_experts`` swaps float SwiGLU layers for ``FusedMoE`` (the Triton kernel in
``kernels.triton.fused_moe``, same grouping, two launches per layer).
On CPU, int8-activation experts (w4a8 / w8a8) become ``moe_a8.A8FusedMoE``: the same grouping,
products and sums in one C++ call per layer.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from specdec.kernels.cpu import cpu_ops


@dataclass
class Routing:
    weights: torch.Tensor  # [T, top_k] routing weight of each chosen expert (float32 or the model dtype)
    expert_ids: torch.Tensor  # [T, top_k] int64


def router_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  owner: nn.Module | None = None) -> torch.Tensor:
    """[T, E] router logits whose every row is the same however many rows the step has. A float32
    CPU matmul is not: one row alone and the same row among 16 differ in the last bits (different
    BLAS paths), and a top-k choice near a tie then routes a verification row to other experts than
    the single-row decode of the same token. On CPU the logits are computed in float64 and rounded
    to float32, where the paths' float64 differences vanish in the rounding. ``owner``: the router
    module that keeps the float64 copies of ``weight`` and ``bias`` (``float64_copy``); without one
    they are made per call."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return F.linear(x, weight, bias)
    if owner is None:
        return F.linear(x.double(), weight.double(), None if bias is None else bias.double()).float()
    bias64 = None if bias is None else float64_copy(owner, "bias", bias)
    return F.linear(x.double(), float64_copy(owner, "weight", weight), bias64).float()


def float64_copy(owner: nn.Module, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A float64 copy of ``owner``'s router tensor ``name`` (a router weight is E x H, small next to one
    expert), kept as ``owner``'s non-persistent buffer ``<name>_float64`` and made again when the tensor is
    written in place or replaced (its version or storage changed) or the buffer was cast."""
    key = f"{name}_float64"
    stamp = (tensor.data_ptr(), tensor._version)
    cached = owner._buffers.get(key)
    if cached is None or cached.dtype != torch.float64 or owner.__dict__.get(f"_{key}_stamp") != stamp:
        cached = tensor.detach().double()
        if key in owner._buffers:
            owner._buffers[key] = cached
        else:
            owner.register_buffer(key, cached, persistent=False)
        owner.__dict__[f"_{key}_stamp"] = stamp
    return cached


class TopKRouter(nn.Module):
    """Router logits ``x W^T (+ b)`` -> top-k experts and their weights.

    ``softmax_first`` (Qwen3-MoE, Mixtral): softmax over all experts in float32, then the top k,
    renormalised to sum 1 when ``normalize``. Otherwise (gpt-oss): the top k logits, then a
    softmax over those k."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, softmax_first: bool = True,
                 normalize: bool = True, bias: bool = False):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}], got {top_k}")
        self.num_experts, self.top_k = num_experts, top_k
        self.softmax_first, self.normalize = softmax_first, normalize
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None

    def forward(self, x: torch.Tensor) -> Routing:
        logits = router_logits(x, self.weight, self.bias, owner=self)  # [T, E]
        if self.softmax_first:
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            weights, ids = torch.topk(probs, self.top_k, dim=-1)
            if self.normalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        else:
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            weights = torch.softmax(top, dim=-1, dtype=top.dtype)
        return Routing(weights, ids)

    def extra_repr(self) -> str:
        order = "softmax, top-k" if self.softmax_first else "top-k, softmax"
        return f"experts={self.num_experts}, top_k={self.top_k}, {order}, normalize={self.normalize}"


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: silu(gate) * up, gate the first half of the last dimension."""
    if cpu_ops.usable(gate_up) and gate_up.stride(-1) == 1:  # one fused op (``cpu_ops``)
        return cpu_ops.extension().silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's activation: gate clamped above at ``limit``, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate); gate the first half of the last dimension (the
    checkpoint's interleaved gate/up rows are reordered at load)."""
    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class Expert(nn.Module):
    """One expert: down(act(gate_up(x))). ``intermediate_size`` is this module's share (tensor
    parallelism may narrow it)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 activation: Callable[[torch.Tensor], torch.Tensor] = silu_mul):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(self.gate_up_proj(x)))


@dataclass
class MoEStats:
    """Counters since construction (or ``reset``): forward calls, experts run (each read once per
    call), and (row, expert) pairs computed."""
    num_calls: int = 0
    num_experts_read: int = 0
    num_pairs: int = 0
    last_experts_read: int = 0  # of the latest call
    history: list[int] = field(default_factory=list, repr=False)  # experts read per call, when recording
    recording: bool = False

    def reset(self) -> None:
        self.num_calls = self.num_experts_read = self.num_pairs = self.last_experts_read = 0
        self.history.clear()


def grouped_experts(x: torch.Tensor, routing: Routing, experts: Sequence[nn.Module],
                    stats: MoEStats | None = None) -> torch.Tensor:
    """sum_j w[t, j] * experts[ids[t, j]](x[t]) for every row t, each touched expert called once on
    all of its rows. x: [T, H] -> [T, H]. Experts are visited in increasing id and their outputs
    accumulated in that order (transformers' order, so float32 sums agree)."""
    num_rows, top_k = routing.expert_ids.shape
    if num_rows == 1:
        return _one_row_experts(x, routing, experts, stats)
    flat_ids = routing.expert_ids.reshape(-1)  # [T * k]: pair p is row p // k, choice p % k
    order = torch.argsort(flat_ids, stable=True)  # pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=len(experts)).tolist()
    flat_weights = routing.weights.reshape(-1)
    out = torch.zeros_like(x)
    start = 0
    touched = 0
    for expert_id, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        touched += 1
        rows = pairs // top_k
        y = experts[expert_id](x[rows]) * flat_weights[pairs, None]
        out.index_add_(0, rows, y.to(x.dtype))
    if stats is not None:
        stats.num_calls += 1
        stats.num_experts_read += touched
        stats.num_pairs += num_rows * top_k
        stats.last_experts_read = touched
        if stats.recording:
            stats.history.append(touched)
    return out


def _one_row_experts(x: torch.Tensor, routing: Routing, experts: Sequence[nn.Module],
                     stats: MoEStats | None) -> torch.Tensor:
    """``grouped_experts`` for one row (batch-1 decode): the same expert calls, products and sums in
    the same order (increasing id), without the sort, count and scatter that grouping needs, whose
    per-call cost is comparable to a small expert's at one row."""
    ids = routing.expert_ids[0].tolist()
    weights = routing.weights[0]
    out = torch.zeros_like(x)
    for choice in sorted(range(len(ids)), key=ids.__getitem__):
        out += (experts[ids[choice]](x) * weights[choice:choice + 1]).to(x.dtype)
    if stats is not None:
        stats.num_calls += 1
        stats.num_experts_read += len(ids)
        stats.num_pairs += len(ids)
        stats.last_experts_read = len(ids)
        if stats.recording:
            stats.history.append(len(ids))
    return out


def reference_moe(x: torch.Tensor, routing: Routing, experts: Sequence[nn.Module]) -> torch.Tensor:
    """The pure-torch reference: each (row, choice) pair on its own, no grouping."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(routing.expert_ids.shape[1]):
            expert = experts[int(routing.expert_ids[t, j])]
            out[t] += (expert(x[t:t + 1])[0] * routing.weights[t, j]).to(x.dtype)
    return out


class SparseMoE(nn.Module):
    """Router (``gate``) + experts, run grouped by expert. x: [T, H] -> [T, H]."""

    def __init__(self, router: TopKRouter, experts: Sequence[nn.Module]):
        super().__init__()
        if len(experts) != router.num_experts:
            raise ValueError(f"{len(experts)} experts for a router over {router.num_experts}")
        self.gate = router
        self.experts = nn.ModuleList(experts)
        self.stats = MoEStats()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return grouped_experts(x, self.gate(x), self.experts, self.stats)


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """``model``'s MoE layers (``SparseMoE``, ``FusedMoE``, ``moe_a8.A8FusedMoE``): each has ``stats``."""
    from specdec.layers.moe_a8 import A8FusedMoE

    return [m for m in model.modules() if isinstance(m, (SparseMoE, FusedMoE, A8FusedMoE))]


def experts_read(model: nn.Module) -> int:
    """Experts read by ``model``'s MoE layers since their stats were last reset, all layers summed."""
    return sum(m.stats.num_experts_read for m in moe_layers(model))


class FusedMoE(nn.Module):
    """A ``SparseMoE`` whose experts run in the Triton fused-MoE kernel (``kernels.triton.fused_moe``: two
    launches per layer, no host sync, so CUDA graphs capture it). Made by ``fuse_experts`` from a
    layer whose experts are plain SwiGLU ``Expert``s without biases: their weights are stacked into
    ``w13`` [E, 2I, H] and ``w2`` [E, H, I]. ``stats`` counts calls and pairs; the experts read per
    call only while ``stats.recording`` (counting them needs a device sync)."""

    def __init__(self, moe: SparseMoE):
        super().__init__()
        self.gate = moe.gate
        self.register_buffer("w13", torch.stack([e.gate_up_proj.weight.detach() for e in moe.experts]))
        self.register_buffer("w2", torch.stack([e.down_proj.weight.detach() for e in moe.experts]))
        self.stats = moe.stats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from specdec.kernels.triton import fused_moe

        routing = self.gate(x)
        self.stats.num_calls += 1
        self.stats.num_pairs += routing.expert_ids.numel()
        if self.stats.recording:
            touched = int(torch.unique(routing.expert_ids).numel())
            self.stats.num_experts_read += touched
            self.stats.last_experts_read = touched
            self.stats.history.append(touched)
        return fused_moe.fused_moe(x, routing.weights, routing.expert_ids, self.w13, self.w2)


def fusable(moe: SparseMoE) -> bool:
    return all(isinstance(e, Expert) and e.activation is silu_mul and type(e.gate_up_proj) is nn.Linear
               and type(e.down_proj) is nn.Linear and e.gate_up_proj.bias is None and e.down_proj.bias is None
               for e in moe.experts)


def fuse_experts(model: nn.Module) -> int:
    """Replace every fusable ``SparseMoE`` of ``model`` by a ``FusedMoE`` (in place); -> how many."""
    count = 0
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, SparseMoE) and fusable(child):
                setattr(module, name, FusedMoE(child))
                count += 1
    return count
