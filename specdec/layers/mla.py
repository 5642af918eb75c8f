"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged cache of compressed latents.

Cache layout, per layer: ``kv_cache: [1, num_blocks, block_size, 1, latent_dim + rope_dim]``:
one plane and one shared "head", so the block pool, slot arithmetic and the KV moves of an
accepted tree path treat it like any per-head cache. A token's slot holds the normalised latent
``c_kv`` (``latent_dim`` = kv_lora_rank values) followed by its rotated shared key ``k_rope``
(``rope_dim`` = qk_rope_head_dim values), nothing per head.

Absorbed form (every row kind): with the up-projection W_UK [H, d_nope, R] folded into the query
(``q_lat = q_nope W_UK``) and W_UV [H, d_v, R] applied after the softmax, attention is one MQA
over the cached rows: query ``[q_lat, q_rope]`` [T, H, R + r] against keys = the cached rows
[L, R + r], values = their latent part [L, R], giving [T, H, R] for the caller to project
through W_UV. Scores equal ``q_nope . k_nope + q_rope . k_rope`` of the uncompressed form, since
``k_nope = W_UK c_kv``.

Expanded form (``mla_attention_expanded``, long prefill chunks): the cached latents of each request
are projected to per-head keys ``[W_UK c_kv, k_rope]`` and values ``W_UV c_kv`` and attended as
usual. Per (query row, key) pair it costs H (d_nope + r + d_v) multiply-adds against the absorbed
form's H (2R + r), plus H R (d_nope + d_v) per key for the projection: it is cheaper once a
request's query rows number more than ``expanded_form_min_rows`` (DeepSeek-V3's dimensions: 171),
which only prefill chunks reach; decode and verification rows stay absorbed.

Masks follow ``specdec.layers.attention``: causal, bottom-right aligned per request, so prefill
chunks, prefix hits, decode rows and K+1 verification rows mix in one call; token trees through
``AttentionMetadata.tree_masks``. ``mla_attention_reference`` is the per-request oracle;
``mla_attention`` batches requests with the torch backend's per-step plan (gather table and
additive mask built once per step and shared by every layer).
"""
from __future__ import annotations

import torch

from specdec.layers.attention import AttentionMetadata
from specdec.layers.attention_torch import MAX_PADDED_QUERY_LEN, _gather, _workspace_buffer, torch_plan


def latent_cache_shape(num_blocks: int, block_size: int, latent_dim: int, rope_dim: int) -> tuple[int, ...]:
    return (1, num_blocks, block_size, 1, latent_dim + rope_dim)


def write_latent(
    latent: torch.Tensor,  # [num_tokens, latent_dim + rope_dim]: c_kv then the rotated k_rope
    kv_cache: torch.Tensor,  # [1, num_blocks, block_size, 1, latent_dim + rope_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    kv_cache.view(-1, kv_cache.shape[-1]).index_copy_(0, slot_mapping, latent.to(kv_cache.dtype))


def mla_attention_reference(
    query: torch.Tensor,  # [num_tokens, num_heads, latent_dim + rope_dim]
    kv_cache: torch.Tensor,  # [1, num_blocks, block_size, 1, latent_dim + rope_dim]
    meta: AttentionMetadata,
    scale: float,
    latent_dim: int,
) -> torch.Tensor:  # [num_tokens, num_heads, latent_dim]
    """Request by request: the scores of each query row against its request's cached rows under
    the causal (or tree) mask, softmax in float32, the weighted sum of the latents."""
    width = kv_cache.shape[-1]
    out = query.new_empty(query.shape[0], query.shape[1], latent_dim)
    qsl, bs = meta.query_start_loc_cpu, meta.block_size
    for r, seq_len in enumerate(meta.seq_lens_cpu):
        start, end = qsl[r], qsl[r + 1]
        q_len = end - start
        if q_len == 0:
            continue
        blocks = meta.block_tables[r, :-(-seq_len // bs)]
        rows = kv_cache[0, blocks].reshape(-1, width)[:seq_len].float()  # [L, R + r]
        q = query[start:end].float().transpose(0, 1)  # [H, q_len, R + r]
        scores = torch.matmul(q, rows.t()) * scale  # [H, q_len, L]
        slot = torch.arange(q_len, device=query.device).unsqueeze(1) + (seq_len - q_len)
        mask = torch.arange(seq_len, device=query.device).unsqueeze(0) <= slot  # [q_len, L]
        tree = meta.tree_masks[r] if meta.tree_masks is not None else None
        if tree is not None:  # from base on, the node's ancestors and itself
            base, node_mask = tree
            mask[:, base:] &= node_mask
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        out[start:end] = torch.matmul(probs, rows[:, :latent_dim]).transpose(0, 1).to(out.dtype)
    return out


def mla_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, latent_dim + rope_dim]
    kv_cache: torch.Tensor,  # [1, num_blocks, block_size, 1, latent_dim + rope_dim]
    meta: AttentionMetadata,
    scale: float,
    latent_dim: int,
) -> torch.Tensor:  # [num_tokens, num_heads, latent_dim]
    """The reference's result with requests batched: every request's cached rows gathered into a
    padded [R, L] batch (one gather per layer, with the step's shared table and mask), scores
    and the weighted sum as two batched matmuls; mixed steps with prefill chunks longer than
    ``MAX_PADDED_QUERY_LEN`` run once per distinct query length, as the torch backend does."""
    if meta.uniform_query_len is None and meta.max_query_len > MAX_PADDED_QUERY_LEN:
        out = query.new_empty(query.shape[0], query.shape[1], latent_dim)
        for rows, sub in meta.query_len_groups():
            out[rows] = mla_attention(query[rows], kv_cache, sub, scale, latent_dim)
        return out
    plan = torch_plan(meta, None)
    num_reqs, num_heads, width = meta.num_reqs, query.shape[1], query.shape[2]
    q_len, key_len = plan.q_len, plan.key_len
    # scores in float32 on CPU at least; a float64 query (``MLAAttention`` on float32 rows) stays float64
    dtype = torch.float32 if query.device.type == "cpu" and query.dtype != torch.float64 else query.dtype
    gathered = _gather(kv_cache[0], plan, "mla_latent")  # [R * blocks, block_size, 1, R + r]
    keys = gathered.view(num_reqs, -1, width)[:, :key_len].to(dtype)  # [R, L, R + r]
    q = query if plan.padded is None else \
        query.new_zeros(num_reqs * q_len, num_heads, width).index_copy_(0, plan.padded[0], query)
    qh = _workspace_buffer(plan.workspace, "mla_q", (num_reqs, num_heads, q_len, width), dtype, query.device)
    qh.copy_(q.view(num_reqs, q_len, num_heads, width).permute(0, 2, 1, 3)).mul_(scale)
    scores = torch.matmul(qh.view(num_reqs, num_heads * q_len, width), keys.transpose(1, 2))  # [R, H*Q, L]
    if plan.bias is not None:  # [R, 1, 1, Q, L]
        scores.view(num_reqs, num_heads, q_len, key_len).add_(plan.bias.view(num_reqs, 1, q_len, key_len))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float64 if dtype == torch.float64 else torch.float32).to(dtype)
    out = torch.matmul(probs, keys[..., :latent_dim])  # [R, H*Q, latent]
    out = out.view(num_reqs, num_heads, q_len, latent_dim).transpose(1, 2).reshape(-1, num_heads, latent_dim)
    out = out.to(query.dtype)
    return out if plan.padded is None else out.index_select(0, plan.padded[0])


def expanded_form_min_rows(latent_dim: int, rope_dim: int, nope_dim: int, v_dim: int) -> int:
    """The query rows per request from which the expanded form takes fewer multiply-adds: q rows
    against L keys cost L q (2R + r) absorbed, L R (d_nope + d_v) + L q (d_nope + r + d_v) expanded."""
    saved_per_pair = 2 * latent_dim + rope_dim - (nope_dim + rope_dim + v_dim)
    if saved_per_pair <= 0:
        return 1 << 30  # never cheaper
    return -(-latent_dim * (nope_dim + v_dim) // saved_per_pair)


def mla_attention_expanded(
    q_nope: torch.Tensor,  # [num_tokens, num_heads, nope_dim]
    q_rope: torch.Tensor,  # [num_tokens, num_heads, rope_dim], rotated
    kv_cache: torch.Tensor,  # [1, num_blocks, block_size, 1, latent_dim + rope_dim]
    meta: AttentionMetadata,
    scale: float,
    w_uk: torch.Tensor,  # [num_heads, nope_dim, latent_dim]
    w_uv: torch.Tensor,  # [num_heads, v_dim, latent_dim]
) -> torch.Tensor:  # [num_tokens, num_heads, v_dim]
    """Attention with every request's cached latents expanded to per-head keys and values (meant
    for steps of long prefill chunks of one query length; any step is computed right), in the
    up-projections' dtype (float64 from ``MLAAttention`` on float32 rows)."""
    if meta.uniform_query_len is None:
        out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1], dtype=w_uv.dtype)
        for rows, sub in meta.query_len_groups():
            out[rows] = mla_attention_expanded(q_nope[rows], q_rope[rows], kv_cache, sub, scale, w_uk, w_uv)
        return out
    plan = torch_plan(meta, None)
    num_reqs, num_heads, latent_dim = meta.num_reqs, q_nope.shape[1], w_uk.shape[2]
    q_len, key_len = plan.q_len, plan.key_len
    rows = _gather(kv_cache[0], plan, "mla_latent").view(num_reqs, -1, kv_cache.shape[-1])[:, :key_len]
    rows = rows.to(w_uk.dtype)
    latent, k_rope = rows[..., :latent_dim], rows[..., latent_dim:]  # [R, L, latent], [R, L, r]
    k_nope = torch.einsum("blr,hnr->bhln", latent, w_uk)  # [R, H, L, d_nope]
    keys = torch.cat([k_nope, k_rope.unsqueeze(1).expand(-1, num_heads, -1, -1)], dim=-1)
    values = torch.einsum("blr,hvr->bhlv", latent, w_uv)  # [R, H, L, d_v]
    query = torch.cat([q_nope, q_rope], dim=-1).to(w_uk.dtype).view(num_reqs, q_len, num_heads, -1).transpose(1, 2)
    mask = None if plan.bias is None else plan.bias.view(num_reqs, 1, q_len, key_len).to(query.dtype)
    out = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale)
    return out.transpose(1, 2).reshape(num_reqs * q_len, num_heads, -1)  # [T, H, d_v]
