"""The batched pure-torch paged attention (``TORCH_BACKEND``): the reference's result
(``specdec.layers.attention``), faster, by grouping requests into padded [R, L] batches whose
masks and gather tables every layer of a step shares."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # attention.py imports this module to build TORCH_BACKEND
    from specdec.layers.attention import AttentionMetadata


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
    allocated once per step instead of once per layer (fresh multi-MB buffers page-fault)."""
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


@dataclass
class TorchPlans:
    """The torch backend's per-step plan (``AttentionMetadata.plan_for("torch", ...)``): one
    ``_TorchPlan`` per sliding window its layers use (None: full attention), built on first use."""
    by_window: dict[int | None, _TorchPlan] = field(default_factory=dict)


def torch_plan(meta: AttentionMetadata, window: int | None) -> _TorchPlan:
    """The plan for layers with this sliding window (None: full attention), built once per step.
    A sliding layer gathers only the blocks from its first row's window on: request r's key
    column c is key ``offset[r] + c``."""
    plans = meta.plan_for("torch", lambda _: TorchPlans()).by_window
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
    verification lengths) run that once per distinct query length, not once per request. The
    gather table and the mask are built once per step, not once per layer. A sliding layer
    gathers only its window's blocks."""
    if meta.uniform_query_len is None and meta.max_query_len > MAX_PADDED_QUERY_LEN:
        # prefill chunks among them: one call per length
        out = torch.empty_like(query)
        for rows, sub in meta.query_len_groups():
            out[rows] = paged_attention_torch(query[rows], kv_cache, sub, scale, sliding_window=sliding_window,
                                              sinks=sinks, softcap=softcap)
        return out
    # decode rows next to verification rows of different K are padded to the longest: one call
    # costs less than one per length
    plan = torch_plan(meta, sliding_window)
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
