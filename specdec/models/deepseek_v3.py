"""DeepSeek-V3 / R1 (``DeepseekV3ForCausalLM``): multi-head latent attention over a cache of
compressed latents, and DeepSeek's mixture of experts.

Attention (MLA): queries through a low-rank pair (``q_a_proj`` -> RMSNorm -> ``q_b_proj``, or one
``q_proj`` when ``q_lora_rank`` is null); keys and values from one latent per token, ``c_kv =
RMSNorm(kv_a_proj_with_mqa(x)[:kv_lora_rank])``, plus a rotary key ``k_rope`` shared by every head.
The paged cache holds those two (kv_lora_rank + qk_rope_head_dim values per token and layer,
``specdec.layers.mla``); the up-projection ``kv_b_proj`` is absorbed: into the query
(q_nope W_UK) before attention and applied to the output (W_UV) after it, then ``o_proj``.
Rotary dimensions that the checkpoint interleaves in pairs (``rope_interleave``) are permuted
once at load (evens, then odds) so the usual rotate-half rotary gives the same scores. The
softmax scale is qk_head_dim^-0.5, times mscale^2 under YaRN with ``mscale_all_dim``.

Feed-forward: the first ``first_k_dense_replace`` layers are dense; the others route each token
to ``num_experts_per_tok`` of ``n_routed_experts`` (``DeepseekRouter``: sigmoid scores, the
correction bias added for the choice only, the choice limited to the ``topk_group`` best of
``n_group`` groups) and add ``n_shared_experts`` always-on experts (one SwiGLU of that many times
``moe_intermediate_size``). Weights come from the unbiased scores, renormalised when
``norm_topk_prob``, times ``routed_scaling_factor``.

Multi-token-prediction layers (``model.layers.{num_hidden_layers + i}``) are skipped here, as
transformers does: they are read by the ``mtp`` speculative method.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from specdec.layers import row_consistent
from specdec.layers.attention import REFERENCE_BACKEND, AttentionBackend, AttentionMetadata
from specdec.layers.mla import (
    expanded_form_min_rows, latent_cache_shape, mla_attention, mla_attention_expanded, write_latent,
)
from specdec.layers.moe import Expert, Routing, SparseMoE, router_logits
from specdec.layers.norm import RMSNorm
from specdec.layers.rotary import _yarn_factor, _yarn_mscale, rotate
from specdec.models.llama import DecoderLayer, LlamaForCausalLM, _cfg, _copy_checked, _rope_params


def softmax_scale(config) -> float:
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    _, scaling = _rope_params(config)
    if scaling and scaling.get("mscale_all_dim"):
        mscale = _yarn_mscale(_yarn_factor(scaling, config.max_position_embeddings), scaling["mscale_all_dim"])
        scale *= mscale * mscale
    return scale


class LatentUpProjection(nn.Module):
    """``kv_b_proj``'s weight [H (d_nope + d_v), R], read as W_UK / W_UV views by the absorbed and
    expanded attention forms; not an ``nn.Linear`` on purpose, so weight-format transforms (which
    repack linears for their kernels) leave it readable."""

    def __init__(self, latent_dim: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, latent_dim))


class MLAAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.latent_dim = config.v_head_dim, config.kv_lora_rank
        self.q_lora_rank = _cfg(config, "q_lora_rank", None)
        bias = bool(_cfg(config, "attention_bias", False))
        hidden, q_out = config.hidden_size, self.num_heads * (self.nope_dim + self.rope_dim)
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank)  # eps 1e-6 whatever rms_norm_eps, as trained
            self.q_b_proj = nn.Linear(self.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.latent_dim + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.latent_dim)
        self.kv_b_proj = LatentUpProjection(self.latent_dim, self.num_heads * (self.nope_dim + self.v_dim))
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, hidden, bias=bias)
        self.scale = softmax_scale(config)
        self.num_kv_heads, self.head_dim = 1, self.rope_dim  # one shared rotary key
        # a request's query rows from which its attention runs expanded (``specdec.layers.mla``)
        self.expanded_min_rows = expanded_form_min_rows(self.latent_dim, self.rope_dim, self.nope_dim, self.v_dim)

    def up_projections(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, d_nope, R], W_UV [H, d_v, R]): views of ``kv_b_proj``'s weight (with ``dtype``
        float64: of its kept float64 copy, ``row_consistent.float64_of``)."""
        w = self.kv_b_proj.weight
        if dtype == torch.float64:
            w = row_consistent.float64_of(w)
        w = w.view(self.num_heads, self.nope_dim + self.v_dim, self.latent_dim)
        return w[:, :self.nope_dim], w[:, self.nope_dim:]

    def forward(self, rope, hidden: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q = self.q_proj(hidden) if self.q_lora_rank is None else \
            self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q_nope, q_rope = q.view(num_tokens, self.num_heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(hidden).split([self.latent_dim, self.rope_dim], dim=-1)
        k_rope = rotate(k_rope.reshape(num_tokens, 1, self.rope_dim), *rope).view(num_tokens, self.rope_dim)
        write_latent(torch.cat([self.kv_a_layernorm(latent), k_rope], dim=-1), kv_cache, meta.slot_mapping)
        q_rope = rotate(q_rope.contiguous(), *rope)
        # float32 on CPU: the up-projections and attention in float64, rounded once at the end, so
        # a row's output does not depend on the step's other rows (``layers.row_consistent``)
        work = row_consistent.compute_dtype(q_nope)
        if meta.max_query_len < self.expanded_min_rows:
            out = self._absorbed(q_nope, q_rope, kv_cache, meta, work).to(q_nope.dtype)
        else:  # long prefill chunks expanded, the step's other rows absorbed
            out = q_nope.new_empty(num_tokens, self.num_heads, self.v_dim)
            groups = meta.query_len_groups() if meta.uniform_query_len is None else [(slice(None), meta)]
            for rows, sub in groups:
                if sub.query_lens[0] >= self.expanded_min_rows:
                    part = mla_attention_expanded(q_nope[rows], q_rope[rows], kv_cache, sub, self.scale,
                                                  *self.up_projections(work))
                else:
                    part = self._absorbed(q_nope[rows], q_rope[rows], kv_cache, sub, work)
                out[rows] = part.to(out.dtype)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.v_dim))

    def _absorbed(self, q_nope, q_rope, kv_cache, meta, work: torch.dtype) -> torch.Tensor:  # [T, H, d_v] in work
        w_uk, w_uv = self.up_projections(work)
        q_latent = torch.bmm(q_nope.transpose(0, 1).to(work), w_uk).transpose(0, 1)  # [T, H, R]
        query = torch.cat([q_latent, q_rope.to(work)], dim=-1)  # [T, H, R + r]
        out = mla_attention(query, kv_cache, meta, self.scale, self.latent_dim)  # [T, H, R]
        return torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


class DeepseekRouter(nn.Module):
    """x [T, H] -> (weights [T, k] float32, expert ids [T, k]); the router runs in float32."""

    def __init__(self, config):
        super().__init__()
        self.num_experts, self.top_k = config.n_routed_experts, config.num_experts_per_tok
        self.num_groups = _cfg(config, "n_group", 1)
        self.topk_groups = _cfg(config, "topk_group", self.num_groups)
        if self.num_experts % self.num_groups:
            raise ValueError(f"n_routed_experts ({self.num_experts}) must divide into n_group ({self.num_groups})")
        self.norm_topk_prob = bool(_cfg(config, "norm_topk_prob", True))
        self.routed_scaling_factor = float(_cfg(config, "routed_scaling_factor", 1.0))
        # float32 whatever the model's dtype, as trained: a rounded router or bias changes which experts run
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> Routing:
        scores = router_logits(x.float(), self.weight, owner=self).sigmoid()  # [T, E]
        biased = scores + self.e_score_correction_bias  # for the choice only
        if self.num_groups > 1:  # a group's score: the sum of its two best biased scores
            grouped = biased.view(-1, self.num_groups, self.num_experts // self.num_groups)
            best = torch.topk(grouped.topk(2, dim=-1)[0].sum(-1), self.topk_groups, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
            biased = biased.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
        ids = torch.topk(biased, self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return Routing(weights * self.routed_scaling_factor, ids)


class DeepseekMoE(nn.Module):
    """The routed experts (a ``SparseMoE``: each touched expert runs once per step on all of its
    rows) plus the shared experts. The checkpoint's ``mlp.gate`` / ``mlp.experts`` live in
    ``routed``, so the weight-format transforms that replace a ``SparseMoE`` keep the shared ones."""

    def __init__(self, config, router_class: type[nn.Module]):
        super().__init__()
        hidden, size = config.hidden_size, config.moe_intermediate_size
        self.routed = SparseMoE(router_class(config), [Expert(hidden, size) for _ in range(config.n_routed_experts)])
        shared = _cfg(config, "n_shared_experts", 0)
        self.shared_experts = Expert(hidden, size * shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.routed(x)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class DeepseekDecoderLayer(DecoderLayer):
    """Llama's pre-norm residual block (its ``forward``) around MLA and DeepSeek's MoE."""

    def __init__(self, config, layer_idx: int, router_class: type[nn.Module] = DeepseekRouter):
        nn.Module.__init__(self)  # its own attention and MLP: not the parent's
        eps = _cfg(config, "rms_norm_eps", 1e-6)
        self.self_attn = MLAAttention(config)
        dense = layer_idx < _cfg(config, "first_k_dense_replace", 0) or not _cfg(config, "n_routed_experts", 0)
        self.mlp = Expert(config.hidden_size, config.intermediate_size) if dense else DeepseekMoE(config, router_class)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)


_LAYER = re.compile(r"^layers\.(\d+)\.")


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    router_class: type[nn.Module] = DeepseekRouter
    rope_interleave = False  # the config's ``rope_interleave`` when it has one, else this

    def __init__(self, config, attn_backend: AttentionBackend = REFERENCE_BACKEND):
        if _cfg(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        super().__init__(config, attn_backend)

    def make_layer(self, config, layer_idx: int, qkv_bias: bool, attn_backend: AttentionBackend) -> nn.Module:
        return DeepseekDecoderLayer(config, layer_idx, self.router_class)

    @property
    def rotary_dim(self) -> int:
        return self.config.qk_rope_head_dim

    @staticmethod
    def kv_cache_token_shape(config) -> tuple[int, int, int]:
        """(planes, heads, values) one token takes in one layer's cache: the latent and the rotary key."""
        return 1, 1, config.kv_lora_rank + config.qk_rope_head_dim

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return latent_cache_shape(num_blocks, block_size, self.config.kv_lora_rank, self.config.qk_rope_head_dim)

    def shard_layers_for_tensor_parallel(self, split) -> None:
        """Resize the (meta-device) layers to one rank's heads and expert widths and add the slices
        to read (``specdec.distributed.tensor_parallel``): the query up-projection (``q_b_proj`` or
        ``q_proj``) and ``kv_b_proj`` column-parallel by head, ``o_proj`` row-parallel by head;
        ``q_a_proj``, ``kv_a_proj_with_mqa`` and their norms whole on every rank. The latent cache
        is so replicated: each rank computes the same latent and rotary key (R + r values per
        token, a fraction of one head's K and V) and its heads read all of it; sharding it would
        split the absorbed scores' sum over R across ranks, a reduction inside every attention.
        Routed and shared experts split their intermediate width; the MoE layer reduces once."""
        from specdec.distributed.tensor_parallel import _check_divides, _linear_like, _shard_feed_forward

        config, world, rank = self.config, split.world, split.rank
        local = split.local_heads
        q_dim, kv_dim = config.qk_nope_head_dim + config.qk_rope_head_dim, config.qk_nope_head_dim + config.v_head_dim
        v_dim, hidden = config.v_head_dim, config.hidden_size
        shared_width = config.moe_intermediate_size * (_cfg(config, "n_shared_experts", 0) or 0)
        _check_divides(world, "shared experts' intermediate size", shared_width)
        first = rank * local
        split.rules += [
            (re.compile(r"\.self_attn\.(q_b_proj|q_proj)\.weight$"), (first * q_dim, (first + local) * q_dim), 0),
            (re.compile(r"\.self_attn\.kv_b_proj\.weight$"), (first * kv_dim, (first + local) * kv_dim), 0),
            (re.compile(r"\.self_attn\.o_proj\.weight$"), (first * v_dim, (first + local) * v_dim), 1),
            (re.compile(r"\.shared_experts\.(gate|up)_proj\.weight$"),
             (rank * shared_width // world, (rank + 1) * shared_width // world), 0),
            (re.compile(r"\.shared_experts\.down_proj\.weight$"),
             (rank * shared_width // world, (rank + 1) * shared_width // world), 1),
        ]
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.num_heads = local
            if attn.q_lora_rank is None:
                attn.q_proj = _linear_like(attn.q_proj, hidden, local * q_dim)
            else:
                attn.q_b_proj = _linear_like(attn.q_b_proj, attn.q_lora_rank, local * q_dim)
            with torch.device(attn.kv_b_proj.weight.device):
                attn.kv_b_proj = LatentUpProjection(attn.latent_dim, local * kv_dim)
            attn.o_proj = _linear_like(attn.o_proj, local * v_dim, hidden)
            if isinstance(mlp, DeepseekMoE):
                for expert in mlp.routed.experts:
                    _shard_feed_forward(expert, hidden, split.local_expert_intermediate)
                if mlp.shared_experts is not None:
                    _shard_feed_forward(mlp.shared_experts, hidden, shared_width // world)
            else:
                _shard_feed_forward(mlp, hidden, split.local_intermediate)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        num_layers = self.config.num_hidden_layers
        for name, tensor in weights:
            name = name.removeprefix("model.")
            layer = _LAYER.match(name)
            if "rotary_emb.inv_freq" in name or (layer and int(layer.group(1)) >= num_layers):
                continue  # MTP layers: read by the ``mtp`` method
            tensor = self._deinterleave_rope(name, tensor)
            name = name.replace(".mlp.gate.", ".mlp.routed.gate.").replace(".mlp.experts.", ".mlp.routed.experts.")
            for part, shard in (("gate_proj", 0), ("up_proj", 1)):
                if f".{part}." in name:
                    name = name.replace(f".{part}.", ".gate_up_proj.")
                    param = self._param(params, name)
                    size = param.shape[0] // 2
                    _copy_checked(param.data.narrow(0, shard * size, size), tensor, f"{name}[{shard}]")
                    loaded.add(f"{name}#{shard}")
                    break
            else:
                _copy_checked(self._param(params, name), tensor, name)
                loaded.add(name)
        expected = {f"{n}#{i}" for n in params if ".gate_up_proj." in n for i in (0, 1)}
        expected |= {n for n in params if ".gate_up_proj." not in n}
        missing = sorted(expected - loaded - ({"lm_head.weight"} if self.tie_word_embeddings else set()))
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weight(s), e.g. {missing[:3]}")

    def _param(self, params: dict, name: str) -> torch.Tensor:
        if name not in params:
            raise ValueError(f"checkpoint has an unexpected weight {name!r} for {type(self).__name__}")
        return params[name]

    def _deinterleave_rope(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Rows of the rotary outputs reordered from pairs (x0, x1), (x2, x3) ... to (x0, x2, ...,
        x1, x3, ...): rotate-half rotary then computes what interleaved rotary computes."""
        config = self.config
        if not _cfg(config, "rope_interleave", self.rope_interleave):
            return tensor
        rope, nope = config.qk_rope_head_dim, config.qk_nope_head_dim
        perm = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
        if name.endswith(("self_attn.q_b_proj.weight", "self_attn.q_proj.weight")):
            heads = tensor.view(-1, nope + rope, tensor.shape[-1])  # this rank's heads under tensor parallelism
            return torch.cat([heads[:, :nope], heads[:, nope:][:, perm]], dim=1).reshape(tensor.shape)
        if ".self_attn.kv_a_proj_with_mqa." in name:
            latent = config.kv_lora_rank
            return torch.cat([tensor[:latent], tensor[latent:][perm]], dim=0)
        return tensor
