"""EAGLE-3 draft head, laid out as the speculators library and vLLM's Eagle3LlamaForCausalLM lay it
out (``models/speculators.py`` reads and writes its folder). Li et al., "EAGLE-3: Scaling up
Inference Acceleration of Large Language Models via Training-Time Test", 2025.

The target exports the residual stream entering a few of its layers (low, middle, high:
``aux_layer_ids``); ``fc`` projects their concatenation [n * H_t] to the head's width H (``combine``).
Head row p reads g_p (that projection of target row p or, from the second draft on, the head's own
pre-norm output of the step before) and the embedding of token p + 1. Layer 0 attends over
[input_layernorm(embedding), hidden_norm(g_p)] (2H wide) with g_p as its residual (hidden_norm(g_p)
with ``norm_before_residual``); further layers are plain decoder layers. The pre-norm output is what
the next draft step reads and, through ``norm`` and the head's own LM head over a reduced draft
vocabulary, the next token's logits; draft id i is target id i + d2t[i].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specdec.layers.attention import AttentionMetadata
from specdec.layers.norm import RMSNorm
from specdec.layers.rotary import RotaryEmbedding
from specdec.models.eagle import _LayerShim
from specdec.models.llama import DecoderLayer, LlamaForCausalLM, _cfg, _rope_params


@dataclass(frozen=True)
class Eagle3Options:
    aux_layer_ids: tuple[int, ...]  # target layers whose input the head reads
    target_hidden_size: int
    draft_vocab_size: int
    norm_before_residual: bool = False
    norm_before_fc: bool = False  # one RMSNorm over the concatenated [n * H_t] features
    fc_norm: bool = False  # one RMSNorm per auxiliary layer's [H_t] features
    norm_output: bool = False  # the next step reads the post-norm output (speculators' "Eagle 3.1")
    own_embedding: bool = False  # False: the target's embedding is shared


class Eagle3FirstLayer(DecoderLayer):
    """The decoder layer whose attention reads [embedding, hidden] (2H) and keeps hidden as residual."""

    def __init__(self, config, qkv_bias: bool, qk_norm: bool, attn_backend, norm_before_residual: bool):
        super().__init__(config, qkv_bias, qk_norm, attn_backend)
        attn = self.self_attn
        attn.qkv_proj = nn.Linear(2 * config.hidden_size, attn.q_size + 2 * attn.kv_size, bias=qkv_bias)
        self.hidden_norm = RMSNorm(config.hidden_size, _cfg(config, "rms_norm_eps", 1e-6))
        self.norm_before_residual = norm_before_residual

    def forward(self, rope, embeds, hidden, kv_cache, meta):
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = self.self_attn(rope, torch.cat([self.input_layernorm(embeds), normed], dim=-1), kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Eagle3Head(nn.Module):
    def __init__(self, config, options: Eagle3Options, attn_backend):
        """``config``: the decoder layers' shape (speculators' ``transformer_layer_config``; its
        ``vocab_size`` is the target's)."""
        super().__init__()
        self.config = config
        self.options = options
        hidden, eps = config.hidden_size, _cfg(config, "rms_norm_eps", 1e-6)
        qkv_bias, qk_norm = bool(_cfg(config, "attention_bias", False)), config.model_type == "qwen3"
        num_aux, target_hidden = len(options.aux_layer_ids), options.target_hidden_size
        self.input_norm = RMSNorm(num_aux * target_hidden, eps) if options.norm_before_fc else None
        self.fc_norm = nn.ModuleList(RMSNorm(target_hidden, eps) for _ in range(num_aux)) if options.fc_norm else None
        self.fc = nn.Linear(num_aux * target_hidden, hidden, bias=False)
        self.layers = nn.ModuleList(
            [Eagle3FirstLayer(config, qkv_bias, qk_norm, attn_backend, options.norm_before_residual)]
            + [DecoderLayer(config, qkv_bias, qk_norm, attn_backend) for _ in range(config.num_hidden_layers - 1)])
        self.norm = RMSNorm(hidden, eps)
        self.lm_head = nn.Linear(hidden, options.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden) if options.own_embedding else None
        theta, scaling = _rope_params(config)
        self.rotary = RotaryEmbedding(self.head_dim, config.max_position_embeddings, theta, scaling)
        # draft id -> target id (d2t's offsets added to the draft ids); None: the vocabularies are one
        self.register_buffer("draft_to_target", None)
        self.target: list[LlamaForCausalLM] = []  # the shared embedding; a list so it is not a submodule

    @property
    def num_kv_heads(self) -> int:
        return self.layers[0].self_attn.num_kv_heads

    @property
    def head_dim(self) -> int:
        return _cfg(self.config, "head_dim", self.config.hidden_size // self.config.num_attention_heads)

    @property
    def d2t(self) -> torch.Tensor | None:
        """speculators' offsets: target id = draft id + d2t[draft id]."""
        if self.draft_to_target is None:
            return None
        return self.draft_to_target - torch.arange(len(self.draft_to_target), device=self.draft_to_target.device)

    def set_draft_vocab(self, target_ids: torch.Tensor | None) -> None:
        """The target ids of the draft vocabulary, in draft-id order (ascending, as speculators sorts them)."""
        self.draft_to_target = None if target_ids is None else target_ids.to(torch.long)

    def attach(self, target: LlamaForCausalLM) -> None:
        if target.config.hidden_size != self.options.target_hidden_size:
            raise ValueError(f"EAGLE-3 head target_hidden_size {self.options.target_hidden_size} does not match the "
                             f"target's hidden_size {target.config.hidden_size}")
        if target.config.vocab_size != self.config.vocab_size:
            raise ValueError(f"EAGLE-3 head vocab_size {self.config.vocab_size} does not match the target's "
                             f"{target.config.vocab_size}")
        bad = [i for i in self.options.aux_layer_ids if not 0 <= i < target.config.num_hidden_layers]
        if bad:
            raise ValueError(f"EAGLE-3 head eagle_aux_hidden_state_layer_ids {list(self.options.aux_layer_ids)} name "
                             f"layer(s) {bad} outside the target's 0..{target.config.num_hidden_layers - 1}")
        self.target = [target]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        table = self.embed_tokens if self.embed_tokens is not None else self.target[0].embed_tokens
        return table(input_ids)

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's exported states [T, n * H_t] -> g [T, H] (what head rows read)."""
        aux = aux.to(self.norm.weight.dtype)  # norms are never packed, linears may be
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:
            aux = torch.cat([norm(x) for norm, x in zip(self.fc_norm, aux.chunk(len(self.fc_norm), dim=-1))], dim=-1)
        return self.fc(aux)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata,
                features: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T] (token p + 1), features [T, H] (g_p; zeros when None: timing runs) -> [T, H]
        the output the next step reads (pre-norm; post-norm with ``norm_output``)."""
        embeds = self.embed(input_ids)
        hidden = torch.zeros_like(embeds) if features is None else features.to(embeds.dtype)
        rope = self.rotary.lookup(positions)
        hidden, residual = self.layers[0](rope, embeds, hidden, kv_caches[0], meta)
        for layer, kv_cache in zip(self.layers[1:], kv_caches[1:]):
            hidden, residual = layer(rope, hidden, residual, kv_cache, meta)
        out = hidden + residual
        return self.norm(out) if self.options.norm_output else out

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] head outputs -> [N, draft vocab] float32 logits."""
        return self.lm_head(hidden if self.options.norm_output else self.norm(hidden)).float()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, target vocab] float32; -inf outside the draft vocabulary (never proposed)."""
        small = self.draft_logits(hidden)
        if self.draft_to_target is None:
            return small
        out = small.new_full((small.shape[0], self.config.vocab_size), float("-inf"))
        return out.index_copy_(1, self.draft_to_target, small)

    # ---- weights under speculators / Hugging Face names ----
    def load_weights(self, weights) -> None:
        """q/k/v and gate/up come split (Hugging Face names) and are fused through the Llama loader."""
        weights = dict(weights)
        d2t = weights.pop("d2t", None)
        weights.pop("t2d", None)  # implied by d2t
        for name in [n for n in weights if n.startswith("verifier_")]:  # speculators' training-only copies
            weights.pop(name)
        if d2t is not None:
            self.draft_to_target = d2t.to(torch.long) + torch.arange(len(d2t))
        elif self.options.draft_vocab_size != self.config.vocab_size:
            raise ValueError(f"EAGLE-3 head has a {self.options.draft_vocab_size}-token draft vocabulary but no d2t")
        params = dict(self.named_parameters())
        own = {n: t for n, t in weights.items() if not n.startswith("layers.")}
        for name, tensor in own.items():
            if name not in params:
                raise ValueError(f"unexpected weight {name!r} in the EAGLE-3 head")
            if tuple(params[name].shape) != tuple(tensor.shape):
                raise ValueError(f"EAGLE-3 head weight {name!r} is {tuple(tensor.shape)}, the config implies "
                                 f"{tuple(params[name].shape)}")
            params[name].data.copy_(tensor)
        missing = {n for n in params if not n.startswith("layers.")} - set(own)
        if missing:
            raise ValueError(f"EAGLE-3 head weights missing: {sorted(missing)}")
        LlamaForCausalLM.load_weights(_LayerShim(self.layers, self.config),
                                      [(n, t) for n, t in weights.items() if n.startswith("layers.")])

    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        """Parameters under speculators names (q/k/v and gate/up split), d2t / t2d included."""
        out = {n: p for n, p in self.named_parameters() if not n.startswith("layers.")}
        for i, layer in enumerate(self.layers):
            attn, mlp, pre = layer.self_attn, layer.mlp, f"layers.{i}."
            q, k, v = attn.qkv_proj.weight.split([attn.q_size, attn.kv_size, attn.kv_size])
            gate, up = mlp.gate_up_proj.weight.split(mlp.intermediate_size)
            parts = {"self_attn.q_proj": q, "self_attn.k_proj": k, "self_attn.v_proj": v, "mlp.gate_proj": gate,
                     "mlp.up_proj": up}
            out.update({f"{pre}{name}.weight": w for name, w in parts.items()})
            if attn.qkv_proj.bias is not None:
                for name, b in zip(("q_proj", "k_proj", "v_proj"),
                                   attn.qkv_proj.bias.split([attn.q_size, attn.kv_size, attn.kv_size])):
                    out[f"{pre}self_attn.{name}.bias"] = b
            for name, p in layer.named_parameters():
                if not name.startswith(("self_attn.qkv_proj", "mlp.gate_up_proj")):
                    out[pre + name] = p
        out = {k: v.detach().contiguous() for k, v in out.items()}
        if self.draft_to_target is not None:
            out["d2t"] = self.d2t.cpu().contiguous()
            t2d = torch.zeros(self.config.vocab_size, dtype=torch.bool)
            t2d[self.draft_to_target.cpu()] = True
            out["t2d"] = t2d
        return out
