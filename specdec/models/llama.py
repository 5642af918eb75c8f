"""Llama-family decoder (Llama 2/3, and the base for Mistral, Qwen2 and Qwen3).

A plain ``nn.Module`` over a flat batch of tokens: ``forward(input_ids [T], positions [T],
kv_caches, attn_meta) -> hidden [T, H]``. Hugging Face parameter names are mapped at load
time (q/k/v fused into ``qkv_proj``, gate/up into ``gate_up_proj``) so each layer runs two
big matmuls instead of five small ones. Family differences are constructor flags read from
the config (QKV bias, per-head q/k norm, each layer's sliding window), never branches on the
model name; a family with more per-layer differences overrides ``attention_options``.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from specdec.kernels.cpu import cpu_ops
from specdec.layers.attention import (
    REFERENCE_BACKEND,
    AttentionBackend,
    AttentionMetadata,
)
from specdec.layers.norm import RMSNorm
from specdec.layers.rotary import RotaryEmbedding, rotate
from specdec.profiling import profile_range


def _cfg(config, name: str, default=None):
    value = getattr(config, name, None)
    return default if value is None else value


def _rope_params(config) -> tuple[float, dict | None]:
    """rope theta and scaling dict, from either the old or the transformers>=5 config layout."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        theta = params.get("rope_theta", _cfg(config, "rope_theta", 10000.0))
        scaling = None if params.get("rope_type", "default") == "default" else dict(params)
        return float(theta), scaling
    return float(_cfg(config, "rope_theta", 10000.0)), getattr(config, "rope_scaling", None)


def layer_sliding_window(config, layer_idx: int) -> int | None:
    """The layer's sliding window as transformers applies it: ``layer_types[i] ==
    "sliding_attention"`` where the config lists layer types, every layer where it sets only
    ``sliding_window`` (Mistral, Mixtral, Phi-3), none where ``use_sliding_window`` is off (Qwen2)."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return int(window) if layer_types[layer_idx] == "sliding_attention" else None
    return int(window)


class Attention(nn.Module):
    """One layer's attention. Per-layer options (``specdec.layers.attention``): ``sliding_window``
    (keys at the last w positions only), ``sinks`` (a learned logit per head in the softmax
    denominator, the ``self_attn.sinks`` weight), ``softcap`` (c * tanh(x / c) on the scores),
    ``scale`` (default head_dim^-0.5), ``norm_class`` for the q/k norms and ``rotary_dim`` (partial
    rotary: only a head's first dimensions rotate)."""

    def __init__(self, config, qkv_bias: bool, qk_norm: bool, attn_backend: AttentionBackend, *,
                 sliding_window: int | None = None, sinks: bool = False, softcap: float | None = None,
                 scale: float | None = None, norm_class: type[nn.Module] = RMSNorm, rotary_dim: int | None = None):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = _cfg(config, "num_key_value_heads", self.num_heads)
        self.head_dim = _cfg(config, "head_dim", config.hidden_size // self.num_heads)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5 if scale is None else scale
        self.rotary_dim = self.head_dim if rotary_dim is None else rotary_dim
        self.sliding_window = sliding_window
        self.softcap = softcap
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if sinks else None
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bool(_cfg(config, "attention_bias", False)))
        eps = _cfg(config, "rms_norm_eps", 1e-6)
        self.q_norm = norm_class(self.head_dim, eps) if qk_norm else None
        self.k_norm = norm_class(self.head_dim, eps) if qk_norm else None
        self.backend = attn_backend

    def options(self) -> dict:
        """The keyword options this layer passes its backend (only those it sets)."""
        opts = {}
        if self.sliding_window is not None:
            opts["sliding_window"] = self.sliding_window
        if self.sinks is not None:
            opts["sinks"] = self.sinks
        if self.softcap is not None:
            opts["softcap"] = self.softcap
        return opts

    def fused_attend(self):
        """The backend's one-call attention from the fused QKV output with this layer's scale, heads
        and options bound (``AttentionBackend.bind_qkv_attend``), or None where the backend has none
        or the layer normalises q / k or rotates part of a head. Bound on first use and again when
        the backend, the sinks tensor or the head count (tensor parallelism) is another."""
        backend, sinks, num_heads = self.backend, self.sinks, self.num_heads
        bound = self.__dict__.get("_fused_attend")
        if bound is None or bound[0] is not backend or bound[1] is not sinks or bound[2] != num_heads:
            fused = backend.bind_qkv_attend is not None and self.q_norm is None and self.rotary_dim == self.head_dim
            attend = backend.bind_qkv_attend(self.scale, num_heads, **self.options()) if fused else None
            bound = self.__dict__["_fused_attend"] = (backend, sinks, num_heads, attend)
        return bound[3]

    def forward(self, rope, hidden, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """rope: the (cos, sin) rows of this step's positions, from ``RotaryEmbedding.lookup``."""
        qkv = self.qkv_proj(hidden)
        if getattr(meta, "window_views", None):  # a hybrid model: this layer's KV cache group
            meta = meta.for_window(self.sliding_window)
        attend = self.fused_attend()
        if attend is not None:
            with profile_range("attention"):
                out = attend(qkv, *rope, kv_cache, meta)
            if out is not None:
                return self.o_proj(out.view(-1, self.q_size))
        opts = self.options()
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        v = v.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is None:
            # queries and keys are adjacent in the fused output: rotate both in one pass
            qk = self._rotate(qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim), rope)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, H, D], [T, Hkv, D]
        else:
            q, k = qk.split([self.q_size, self.kv_size], dim=-1)
            q = self.q_norm(q.view(-1, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))
            q, k = self._rotate(q, rope), self._rotate(k, rope)
        with profile_range("attention"):
            self.backend.write_kv(k, v, kv_cache, meta.slot_mapping)
            out = self.backend.attend(q, kv_cache, meta, self.scale, **opts)  # [T, H, D]
        return self.o_proj(out.reshape(-1, self.q_size))

    def _rotate(self, x: torch.Tensor, rope) -> torch.Tensor:  # [T, heads, D]
        if self.rotary_dim == self.head_dim:
            return rotate(x, *rope)
        return torch.cat([rotate(x[..., :self.rotary_dim].contiguous(), *rope), x[..., self.rotary_dim:]], dim=-1)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        bias = bool(_cfg(config, "mlp_bias", False))
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        if _cfg(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        ops = cpu_ops.ops_for(gate_up)
        if ops is not None and gate_up.stride(-1) == 1:  # one fused op
            return self.down_proj(ops.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config, qkv_bias: bool, qk_norm: bool, attn_backend: AttentionBackend, **attn_options):
        """``attn_options``: the layer's ``Attention`` keyword options."""
        super().__init__()
        eps = _cfg(config, "rms_norm_eps", 1e-6)
        self.self_attn = Attention(config, qkv_bias, qk_norm, attn_backend, **attn_options)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, rope, hidden, residual, kv_cache, meta):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    qk_norm = False
    norm_class: type[nn.Module] = RMSNorm  # the final norm's (a family's own layers choose theirs)

    def __init__(self, config, attn_backend: AttentionBackend = REFERENCE_BACKEND):
        super().__init__()
        self.config = config
        qkv_bias = self.qkv_bias or bool(_cfg(config, "attention_bias", False))
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(config, i, qkv_bias, attn_backend)
                                    for i in range(config.num_hidden_layers))
        self.norm = self.norm_class(config.hidden_size, _cfg(config, "rms_norm_eps", 1e-6))
        theta, scaling = _rope_params(config)
        self.rotary = RotaryEmbedding(self.rotary_dim, config.max_position_embeddings, theta, scaling)
        self.tie_word_embeddings = bool(_cfg(config, "tie_word_embeddings", False))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def make_layer(self, config, layer_idx: int, qkv_bias: bool, attn_backend: AttentionBackend) -> nn.Module:
        """Decoder layer ``layer_idx`` (a family with its own layer structure overrides this)."""
        return DecoderLayer(config, qkv_bias, self.qk_norm, attn_backend, **self.attention_options(config, layer_idx))

    @property
    def rotary_dim(self) -> int:
        """The rotated dimensions of a head (a family with partial rotary overrides this)."""
        return self.head_dim

    def attention_options(self, config, layer_idx: int) -> dict:
        """Layer ``layer_idx``'s ``Attention`` keyword options (a family overrides this)."""
        window = layer_sliding_window(config, layer_idx)
        return {} if window is None else {"sliding_window": window}

    def rope_rows(self, positions: torch.Tensor, meta: AttentionMetadata):
        """The step's rotary (cos, sin) rows, shared by every layer (a family whose table depends
        on more than the position overrides this)."""
        return self.rotary.lookup(positions)

    @property
    def num_kv_heads(self) -> int:
        return self.layers[0].self_attn.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.layers[0].self_attn.head_dim

    def forward(self, input_ids, positions, kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                aux_layers: tuple[int, ...] = ()):
        """-> final hidden [T, H]; with ``aux_layers`` (an EAGLE-3 head's layer ids) also the
        residual stream entering each of those layers, concatenated in their order: [T, n * H]."""
        hidden = self.embed_tokens(input_ids)  # [T, H]
        residual = None
        rope = self.rope_rows(positions, meta)  # once per step, not once per layer
        collected: dict[int, torch.Tensor] = {}
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            if i in aux_layers:  # vLLM's convention: layer L's input, i.e. Hugging Face hidden_states[L]
                collected[i] = hidden if residual is None else hidden + residual
            hidden, residual = layer(rope, hidden, residual, kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        if not aux_layers:
            return hidden
        return hidden, torch.cat([collected[i] for i in aux_layers], dim=-1)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, V] float32 logits, into ``out`` when given (``ModelRunner.reuse_logits``)."""
        logits = self.lm_head(hidden)
        return logits.float() if out is None else out.copy_(logits)

    # ---- loading: Hugging Face names -> fused modules ----
    _stacked = (
        ("qkv_proj", "q_proj", 0), ("qkv_proj", "k_proj", 1), ("qkv_proj", "v_proj", 2),
        ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
    )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            for fused, part, shard in self._stacked:
                if f".{part}." in name:
                    name = name.replace(f".{part}.", f".{fused}.")
                    self._load_shard(params, name, tensor, shard, fused)
                    loaded.add(f"{name}#{shard}")
                    break
            else:
                if name not in params:
                    raise ValueError(f"checkpoint has an unexpected weight {name!r} for {type(self).__name__}")
                _copy_checked(params[name], tensor, name)
                loaded.add(name)
        expected = set()
        for name in params:
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            fused = next((f for f, _, _ in self._stacked if f".{f}." in name), None)
            if fused is None:
                expected.add(name)
            else:
                n = 3 if fused == "qkv_proj" else 2
                expected.update(f"{name}#{i}" for i in range(n))
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weight(s), e.g. {missing[:3]}")

    def _load_shard(self, params, name: str, tensor: torch.Tensor, shard: int, fused: str) -> None:
        if name not in params:
            raise ValueError(f"checkpoint has an unexpected weight {name!r} for {type(self).__name__}")
        param = params[name]
        if fused == "qkv_proj":
            attn = self.layers[0].self_attn
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        else:  # the owning module's size: dense and expert feed-forwards may differ
            sizes = [self.get_submodule(name.rsplit(".", 2)[0]).intermediate_size] * 2
        offset = sum(sizes[:shard])
        _copy_checked(param.data.narrow(0, offset, sizes[shard]), tensor, name.replace(fused, f"{fused}[{shard}]"))


def _copy_checked(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(
            f"shape mismatch for weight {name!r}: checkpoint has {tuple(tensor.shape)}, "
            f"the config implies {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.data.copy_(tensor)
