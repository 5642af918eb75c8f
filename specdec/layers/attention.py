"""Attention over the paged KV cache: metadata, backends and the pure-torch reference (the batched
torch path is ``specdec.layers.attention_torch``).

Cache layout, per layer: ``kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 = keys, 1 = values). A token's *slot* is ``block_id * block_size + offset``.

A step's batch is flat: requests are concatenated along the token axis, each contributing
``q_len`` query tokens (a prefill chunk, the K+1 verification rows, or one decode row).
Query token ``j`` of request ``r`` sits at position ``seq_len[r] - q_len[r] + j`` and attends
to every key at positions ``0 ..`` that position (causal, bottom-right aligned), so prefill
chunks, verification rows and decode rows mix in one call. This stays the oracle that
faster kernels (``specdec.kernels``) are tested against.

Token trees (``AttentionMetadata.tree_masks``): a request that verifies or drafts a tree of
candidate tokens writes its nodes to consecutive slots from position ``base`` on, and each of
its query rows sees the keys before ``base`` (causally: none past its own slot) plus the keys
from ``base`` on that its mask row allows (the node's ancestors and itself). Such a request's
rows carry their own positions (``base - 1 + depth``), which need not equal their slots.
Kernels read the masks packed into bits (``specdec.layers.tree_mask``).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.nn.functional as F

from specdec.layers.tree_mask import PackedTreeMask, pack_tree_masks

_Plan = TypeVar("_Plan")

@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [num_reqs + 1] int64, cumulative query lengths
    seq_lens: torch.Tensor  # [num_reqs] int64, context length after this step's tokens
    block_tables: torch.Tensor  # [num_reqs, max_blocks_per_req] int64 (padded with 0)
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot of each new token
    # host copies, so the reference loop does not synchronise with the device
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int
    # per request, None (causal) or (base, mask [q_len, seq_len - base] bool): see the module docstring
    tree_masks: list | None = None
    # the same masks packed for kernels; set directly by a captured graph, else packed on first use
    tree_packed: PackedTreeMask | None = None
    # LoRA: each row's adapter slot (``specdec.layers.lora.LoRAMapping``); None: the base model
    lora_mapping: object | None = None
    # hybrid models: the metadata of the layers with each of these sliding windows, which read
    # their own KV cache group's block tables and slots (``engine/kv_layout.py``); None: one group
    window_views: dict | None = field(default=None, repr=False, compare=False)
    # derived once per step from the host copies and shared by every layer
    query_lens: list[int] = field(init=False, repr=False, compare=False)  # [num_reqs]
    _groups: list | None = field(default=None, init=False, repr=False, compare=False)
    _padded: tuple | None = field(default=None, init=False, repr=False, compare=False)
    # each backend's own per-step plan under the backend's name (``plan_for``); never read here
    backend_plans: dict[str, object] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        q = self.query_start_loc_cpu
        self.query_lens = [q[i + 1] - q[i] for i in range(len(q) - 1)]

    def packed_tree(self) -> PackedTreeMask | None:
        """The step's tree masks packed into bits (cached: every layer reuses them), or None."""
        if self.tree_packed is None and self.tree_masks is not None:
            self.tree_packed = pack_tree_masks(self.tree_masks, self.query_start_loc_cpu, self.seq_lens_cpu,
                                               self.seq_lens.device)
        return self.tree_packed

    def for_window(self, window: int | None) -> AttentionMetadata:
        """The metadata a layer with this sliding window reads (itself with one KV cache group)."""
        return self if self.window_views is None else self.window_views.get(window, self)

    def plan_for(self, backend: str, build: Callable[[AttentionMetadata], _Plan]) -> _Plan:
        """The per-step plan of ``backend`` (its own typed object: gather tables, masks, tree
        inputs), built by ``build`` from this metadata for the step's first layer and shared by
        the others. The metadata holds plans without knowing their types."""
        plan = self.backend_plans.get(backend)
        if plan is None:
            plan = self.backend_plans[backend] = build(self)
        return plan

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)

    @property
    def uniform_query_len(self) -> int | None:
        """The query length every request shares, or None for a mixed step."""
        q_lens = self.query_lens
        return q_lens[0] if q_lens and all(q == q_lens[0] for q in q_lens) else None

    def padded_rows(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """For running every request at the step's longest query length q_max: the padded
        position r * q_max + j of each real query row [T], the query lengths [R], and q_max.
        Cached: every layer of the step reuses it."""
        if self._padded is None:
            q_max = self.max_query_len
            dest = [r * q_max + j for r, q in enumerate(self.query_lens) for j in range(q)]
            device = self.seq_lens.device
            self._padded = (torch.tensor(dest, device=device), torch.tensor(self.query_lens, device=device), q_max)
        return self._padded

    def query_len_groups(self) -> list[tuple[torch.Tensor, "AttentionMetadata"]]:
        """The requests bucketed by query length: (their query rows [n], metadata of the bucket
        alone) per distinct length. Cached: every layer of the step reuses it."""
        if self._groups is None:
            qsl = self.query_start_loc_cpu
            by_len: dict[int, list[int]] = {}
            for r, q_len in enumerate(self.query_lens):
                if q_len:
                    by_len.setdefault(q_len, []).append(r)
            device = self.seq_lens.device
            self._groups = []
            for q_len, reqs in by_len.items():
                rows = torch.tensor([i for r in reqs for i in range(qsl[r], qsl[r + 1])], device=device)
                sel = torch.tensor(reqs, device=device)
                starts = list(range(0, (len(reqs) + 1) * q_len, q_len))
                sub = AttentionMetadata(
                    torch.tensor(starts, device=device), self.seq_lens[sel], self.block_tables[sel],
                    self.slot_mapping, starts, [self.seq_lens_cpu[r] for r in reqs], self.block_size,
                    None if self.tree_masks is None else [self.tree_masks[r] for r in reqs])
                self._groups.append((rows, sub))
        return self._groups


@dataclass(frozen=True)
class AttentionBackend:
    """The two cache operations a model layer needs; chosen once per engine (torch or Triton)."""
    name: str
    write_kv: Callable  # (key, value, kv_cache, slot_mapping) -> None
    # (query, kv_cache, meta, scale, **options) -> [num_tokens, num_heads, head_dim]; options:
    # sliding_window, sinks, softcap (the module docstring), passed only by layers that set them
    attend: Callable
    # optional, all three in one call from the fused QKV output [T, (H + 2 Hkv) D] (rotary
    # included), bound once per layer: (scale, num_heads, **options) -> a callable (qkv, cos, sin,
    # kv_cache, meta) -> [T, H, D], or None where it does not apply (the caller then runs rotary,
    # write_kv and attend)
    bind_qkv_attend: Callable | None = None


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    kv_cache[0].view(num_slots, *kv_cache.shape[3:]).index_copy_(0, slot_mapping, key)
    kv_cache[1].view(num_slots, *kv_cache.shape[3:]).index_copy_(0, slot_mapping, value)


def paged_attention_reference(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    *,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]
    softcap: float | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each request's query rows over its cached keys/values (the options:
    see the module docstring)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    block_size = meta.block_size
    out = torch.empty_like(query)
    qsl = meta.query_start_loc_cpu
    for r, seq_len in enumerate(meta.seq_lens_cpu):
        start, end = qsl[r], qsl[r + 1]
        q_len = end - start
        if q_len == 0:
            continue
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = meta.block_tables[r, :num_blocks]
        k = kv_cache[0, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]  # [seq_len, Hkv, D]
        v = kv_cache[1, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        q = query[start:end].transpose(0, 1)  # [H, q_len, D]
        k = k.transpose(0, 1)  # [Hkv, seq_len, D]
        v = v.transpose(0, 1)
        if group > 1:
            k = k.repeat_interleave(group, dim=0)
            v = v.repeat_interleave(group, dim=0)
        mask = None
        tree = meta.tree_masks[r] if meta.tree_masks is not None else None
        if tree is not None or q_len > 1 or sliding_window is not None:
            # bottom-right causal: row j sees keys <= seq_len - q_len + j
            rows = torch.arange(q_len, device=query.device).unsqueeze(1) + (seq_len - q_len)
            cols = torch.arange(seq_len, device=query.device).unsqueeze(0)
            mask = cols <= rows  # [q_len, seq_len]
            if sliding_window is not None:
                pos = rows  # [q_len, 1] each row's position: its slot, or base - 1 + depth in a tree
                if tree is not None:
                    depth = tree[1].sum(-1, keepdim=True)
                    if int(depth.max()) > sliding_window:
                        raise ValueError(f"a token tree of depth {int(depth.max())} exceeds the sliding window "
                                         f"of {sliding_window} positions")
                    pos = torch.where(depth > 0, tree[0] - 1 + depth, rows)
                in_window = cols > pos - sliding_window
                if tree is not None:  # tree keys are ancestors, within the window (depth <= window)
                    in_window[:, tree[0]:] = True
                mask &= in_window
        if tree is not None:  # from base on, the node's ancestors and itself
            base, node_mask = tree
            mask[:, base:] &= node_mask
        if sinks is None and softcap is None:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        else:
            o = _explicit_attention(q, k, v, mask, scale, sinks, softcap)
        out[start:end] = o.transpose(0, 1)
    return out


def _explicit_attention(q, k, v, mask, scale: float, sinks, softcap) -> torch.Tensor:
    """softmax(scores [, sink]) @ v written out, for the options SDPA does not take.
    q [H, Q, D], k / v [H, L, D], mask [Q, L] bool or None -> [H, Q, D]."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [H, Q, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:  # one more logit per head, in the denominator only
        sink = sinks.float().view(-1, 1, 1).expand(scores.shape[0], scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.float()).to(q.dtype)


from specdec.layers.attention_torch import paged_attention_torch  # noqa: E402 (it builds on the above)

REFERENCE_BACKEND = AttentionBackend("reference", write_kv_cache, paged_attention_reference)
TORCH_BACKEND = AttentionBackend("torch", write_kv_cache, paged_attention_torch)
