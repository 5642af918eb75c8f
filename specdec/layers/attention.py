"""Attention over the paged KV cache (pure-torch reference).

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

import torch
import torch.nn.functional as F

from specdec.layers.tree_mask import PackedTreeMask, pack_tree_masks


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
    # derived once per step from the host copies and shared by every layer
    query_lens: list[int] = field(init=False, repr=False, compare=False)  # [num_reqs]
    _groups: list | None = field(default=None, init=False, repr=False, compare=False)
    _padded: tuple | None = field(default=None, init=False, repr=False, compare=False)
    _torch_plan: object | None = field(default=None, init=False, repr=False, compare=False)
    _rows_plan: object | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        q = self.query_start_loc_cpu
        self.query_lens = [q[i + 1] - q[i] for i in range(len(q) - 1)]

    def packed_tree(self) -> PackedTreeMask | None:
        """The step's tree masks packed into bits (cached: every layer reuses them), or None."""
        if self.tree_packed is None and self.tree_masks is not None:
            self.tree_packed = pack_tree_masks(self.tree_masks, self.query_start_loc_cpu, self.seq_lens_cpu,
                                               self.seq_lens.device)
        return self.tree_packed

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
    # included): (qkv, cos, sin, kv_cache, meta, scale, num_heads) -> [T, H, D], or None where it
    # does not apply (the caller then runs rotary, write_kv and attend)
    qkv_attend: Callable | None = None


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


def _grouped_attention(
    q: torch.Tensor,  # [R, Q, H, D]
    k: torch.Tensor,  # [R, L, Hkv, D]
    v: torch.Tensor,  # [R, L, Hkv, D]
    bias: torch.Tensor | None,  # [R, 1, 1, Q, L] float32, 0 = may attend, -inf = may not
    scale: float,
    workspace: dict | None = None,  # buffers reused by every layer of a step (``_TorchPlan``)
    sinks: torch.Tensor | None = None,  # [H]
    softcap: float | None = None,
) -> torch.Tensor:  # [R * Q, H, D]
    """matmul -> float32 softmax -> matmul, with each KV head serving its query group directly
    (no repeated K/V). On CPU this is 3-30x faster than SDPA for decode-shaped queries in bf16.
    The matmuls run in float32 on CPU, so the scores keep float32 precision (bf16 matmuls would
    round them to 8 mantissa bits before the softmax). Each operand is converted and laid out for
    its matmul in one copy ([R, Hkv, L, D]: K is read transposed by BLAS, V as it is), the scale
    goes on the few query rows instead of the scores, and with a ``workspace`` these buffers are
    allocated once per step instead of once per layer (fresh multi-MB buffers page-fault: the
    same batch-32 call took 1.7-6.7 ms with per-call buffers)."""
    num_reqs, q_len, num_heads, head_dim = q.shape
    num_kv_heads, seq_len = k.shape[2], k.shape[1]
    group = num_heads // num_kv_heads
    out_dtype = q.dtype
    dtype = torch.float32 if q.device.type == "cpu" else q.dtype
    workspace = {} if workspace is None else workspace

    def buffer(name: str, shape) -> torch.Tensor:
        return _workspace_buffer(workspace, name, shape, dtype, q.device)

    def laid_out(name: str, x: torch.Tensor, shape, perm) -> torch.Tensor:
        return buffer(name, shape).copy_(x.permute(perm))

    qg = laid_out("q", q.view(num_reqs, q_len, num_kv_heads, group, head_dim),
                  (num_reqs, num_kv_heads, group, q_len, head_dim), (0, 2, 3, 1, 4)).mul_(scale)
    kt = laid_out("k", k, (num_reqs, num_kv_heads, seq_len, head_dim), (0, 2, 1, 3))
    vt = laid_out("v", v, (num_reqs, num_kv_heads, seq_len, head_dim), (0, 2, 1, 3))
    scores = buffer("scores", (num_reqs, num_kv_heads, group * q_len, seq_len))
    torch.matmul(qg.view(num_reqs, num_kv_heads, group * q_len, head_dim), kt.transpose(-1, -2), out=scores)
    if softcap is not None:
        scores.div_(softcap).tanh_().mul_(softcap)
    if bias is not None:
        scores.view(num_reqs, num_kv_heads, group, q_len, seq_len).add_(bias)
    if sinks is not None:  # each head's sink logit joins the softmax as one more key without a value
        sink = sinks.to(scores.dtype).view(num_kv_heads, group, 1).expand(num_kv_heads, group, q_len)
        sink = sink.reshape(1, num_kv_heads, group * q_len, 1).expand(num_reqs, -1, -1, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)[..., :-1].to(dtype)
    else:  # softmax in float32 (on GPUs the bf16 scores are upcast for it)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
    out = torch.matmul(probs, vt)  # [R, Hkv, G*Q, D]
    out = out.view(num_reqs, num_kv_heads, group, q_len, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(num_reqs * q_len, num_heads, head_dim).to(out_dtype)


MAX_PADDED_QUERY_LEN = 17  # mixed steps up to K = 16 verification rows run as one padded call


@dataclass
class _TorchPlan:
    """What every layer of a step with one sliding window (or none) shares in
    ``paged_attention_torch``: computed once per step and window."""
    q_len: int  # rows per request in the call (the longest, when padded)
    key_len: int  # keys gathered per request (its window's blocks, or its whole context)
    table: torch.Tensor  # [R * num_blocks] the block ids to gather
    bias: torch.Tensor | None  # [R, 1, 1, q_len, key_len] float32 additive mask
    padded: tuple | None  # ``AttentionMetadata.padded_rows()`` for mixed query lengths
    workspace: dict = field(default_factory=dict)  # gather and matmul buffers, reused layer after layer


def _torch_plan(meta: AttentionMetadata, window: int | None) -> _TorchPlan:
    """The plan for layers with this sliding window (None: full attention), cached on the step.
    A sliding layer gathers only the blocks from its first row's window on: request r's key
    column c is key ``offset[r] + c``."""
    plans = meta._torch_plan if meta._torch_plan is not None else {}
    meta._torch_plan = plans
    seq_lens, bs = meta.seq_lens_cpu, meta.block_size
    max_len = max(seq_lens)
    if window is not None and window >= max_len:
        window = None  # no key of the step is that far back
    if window in plans:
        return plans[window]
    padded = meta.padded_rows() if meta.uniform_query_len is None else None
    q_len = padded[2] if padded else meta.uniform_query_len
    device = meta.seq_lens.device
    if window is None:
        first_blocks = None
        num_blocks = -(-max_len // bs)
        table = meta.block_tables[:, :num_blocks].reshape(-1)  # index_select on it: ~3x cheaper than [table]
        key_len = max_len
    else:  # every row sees keys from (its first row's position) - window + 1 on (tree nodes sit later)
        firsts = [max(0, s - q - window + 1) // bs for s, q in zip(seq_lens, meta.query_lens)]
        num_blocks = max(-(-s // bs) - f for s, f in zip(seq_lens, firsts))
        first_blocks = torch.tensor(firsts, device=device)
        index = (first_blocks[:, None] + torch.arange(num_blocks, device=device)).clamp_(
            max=meta.block_tables.shape[1] - 1)  # past a request's last block: keys its mask hides
        table = meta.block_tables.gather(1, index).reshape(-1)
        key_len = max(s - f * bs for s, f in zip(seq_lens, firsts))
    bias = None
    if q_len > 1 or min(seq_lens) != max_len or meta.tree_masks is not None or window is not None:
        # row j of request r sees keys <= seq_len[r] - q_len[r] + j (bottom-right causal, padding
        # hidden); a padding row (j >= q_len[r]) sees at least its request's first gathered key,
        # so its softmax stays finite
        rows = torch.arange(q_len, device=device).view(1, q_len, 1)
        cols = torch.arange(key_len, device=device).view(1, 1, key_len)
        if first_blocks is not None:
            cols = cols + (first_blocks * bs).view(-1, 1, 1)  # [R, 1, L] key positions
        lens = padded[1].view(-1, 1, 1) if padded else q_len
        limit = meta.seq_lens.view(-1, 1, 1) - lens + rows  # [R, q, 1] each row's slot
        allowed = cols <= limit  # [R, q, L]
        if window is not None:
            pos = limit.expand(-1, q_len, 1).clone()  # [R, q, 1] each row's position
            for r, tree in enumerate(meta.tree_masks or ()):
                if tree is not None:  # a tree node sits at base - 1 + depth
                    depth = tree[1].sum(-1)
                    if int(depth.max()) > window:
                        raise ValueError(f"a token tree of depth {int(depth.max())} exceeds the sliding window "
                                         f"of {window} positions")
                    pos[r, :depth.shape[0], 0] = torch.where(depth > 0, tree[0] - 1 + depth, pos[r, :depth.shape[0], 0])
            allowed &= (cols > pos - window) | (rows >= lens)  # padding rows keep their first key
        for r, tree in enumerate(meta.tree_masks or ()):
            if tree is not None:  # a token tree: causal before base, then its own mask
                base, node_mask = tree
                n = node_mask.shape[0]
                col = base - (0 if first_blocks is None else int(first_blocks[r]) * bs)
                if window is not None:  # tree keys are ancestors, inside the window: causal alone
                    allowed[r, :n, col:] = cols[r, :, col:] <= limit[r, :n]
                allowed[r, :n, col:col + node_mask.shape[1]] &= node_mask
        bias = torch.zeros(allowed.shape, dtype=torch.float32, device=device).masked_fill_(~allowed, float("-inf"))
        bias = bias[:, None, None]
    plans[window] = _TorchPlan(q_len, key_len, table, bias, padded)
    return plans[window]


def paged_attention_torch(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    *,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]
    softcap: float | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """The reference's result, faster: when every request has the same query length (pure
    decode steps, or verification steps with one K) all requests go through one grouped
    attention over keys gathered into a padded [R, L] batch and masked per request; mixed
    steps (prefill chunks next to decode rows, or adaptive K giving requests different
    verification lengths) run that once per distinct query length, not once per request
    (measured: a batch-32 step with a few K > 0 requests cost 6-10% more than a pure decode
    step when it went request by request). The gather table and the mask are built once per
    step, not once per layer (measured on the 1.1B Llama at K = 5: attention 10.1 -> 5.3 ms of a
    52 ms step). A sliding layer gathers only its window's blocks."""
    if meta.uniform_query_len is None and meta.max_query_len > MAX_PADDED_QUERY_LEN:
        # prefill chunks among them: one call per length
        out = torch.empty_like(query)
        for rows, sub in meta.query_len_groups():
            out[rows] = paged_attention_torch(query[rows], kv_cache, sub, scale, sliding_window=sliding_window,
                                              sinks=sinks, softcap=softcap)
        return out
    # decode rows next to verification rows of different K are padded to the longest, one call
    # (a call per length cost ~10 ms per batch-32 step on a 30-layer model)
    plan = _torch_plan(meta, sliding_window)
    num_reqs = meta.num_reqs
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, bs = kv_cache.shape[3], meta.block_size
    q_len, key_len, bias = plan.q_len, plan.key_len, plan.bias
    width = plan.table.shape[0] // num_reqs * bs
    k, v = (_gather(kv_cache[i], plan, f"gather{i}").view(num_reqs, width, num_kv_heads, head_dim)[:, :key_len]
            for i in (0, 1))
    if plan.padded is None:
        return _grouped_attention(query.view(num_reqs, q_len, num_heads, head_dim), k, v, bias, scale,
                                  plan.workspace, sinks, softcap)
    dest = plan.padded[0]
    q = query.new_zeros(num_reqs * q_len, num_heads, head_dim).index_copy_(0, dest, query)
    return _grouped_attention(q.view(num_reqs, q_len, num_heads, head_dim), k, v, bias, scale,
                              plan.workspace, sinks, softcap).index_select(0, dest)


def _workspace_buffer(workspace: dict, name: str, shape, dtype: torch.dtype, device) -> torch.Tensor:
    """``workspace[name]``, re-made when the shape, dtype or device asked for differs."""
    shape = torch.Size(shape)
    buf = workspace.get(name)
    if buf is None or buf.shape != shape or buf.dtype != dtype or buf.device != device:
        buf = workspace[name] = torch.empty(shape, dtype=dtype, device=device)
    return buf


def _gather(cache: torch.Tensor, plan: _TorchPlan, name: str) -> torch.Tensor:
    """The step's blocks of one layer's K or V cache, into a buffer every layer reuses."""
    shape = (plan.table.shape[0], *cache.shape[1:])
    out = _workspace_buffer(plan.workspace, name, shape, cache.dtype, cache.device)
    return torch.index_select(cache, 0, plan.table, out=out)


REFERENCE_BACKEND = AttentionBackend("reference", write_kv_cache, paged_attention_reference)
TORCH_BACKEND = AttentionBackend("torch", write_kv_cache, paged_attention_torch)
