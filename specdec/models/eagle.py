"""EAGLE-style draft head: one decoder layer that drafts in the target's own feature space.

Row p of the head reads the target's final (post-norm) hidden state f_p and the embedding of
the token at p + 1, and predicts f_{p+1}; the target's own LM head turns that prediction into
logits for the token at p + 2. Drafting K tokens is then one catch-up pass over the positions
the target verified since the last proposal (real features) and K - 1 passes that feed the
head its own predicted feature. The head shares the target's embedding and LM head (neither
is saved), so a head for a 135M target is ~4M parameters. (Li et al., "EAGLE: Speculative
Sampling Requires Rethinking Feature Uncertainty", 2024.)

Folder format: ``config.json`` (a Llama config for the layer's shape, plus
``"specdec_eagle": {"target_hidden_size": H}``) and ``model.safetensors`` holding ``fc.weight``
[H, 2H], ``layers.0.*`` (Hugging Face Llama layer names) and ``norm.weight``.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdec.layers.attention import AttentionMetadata
from specdec.layers.norm import RMSNorm
from specdec.layers.rotary import RotaryEmbedding
from specdec.models.llama import DecoderLayer, LlamaForCausalLM, _cfg, _rope_params

EAGLE_KEY = "specdec_eagle"


def is_eagle_folder(path: str | Path) -> bool:
    config = Path(path) / "config.json"
    return config.is_file() and EAGLE_KEY in json.loads(config.read_text())


class EagleHead(nn.Module):
    def __init__(self, config, attn_backend):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(config, bool(_cfg(config, "attention_bias", False)), False,
                                                  attn_backend)])
        self.norm = RMSNorm(hidden, _cfg(config, "rms_norm_eps", 1e-6))
        theta, scaling = _rope_params(config)
        self.rotary = RotaryEmbedding(self.head_dim, config.max_position_embeddings, theta, scaling)
        self.target: list[LlamaForCausalLM] = []  # shared embedding + LM head; a list so it is not a submodule
        # optional draft vocabulary: the target's most frequent tokens; drafting scores only
        # those rows of the LM head (on a 49k-vocab 135M target the full head is a fifth of a
        # target step per draft token). Drafts never propose other tokens: a miss, never an error.
        self.register_buffer("draft_vocab", None)
        self._vocab_weight: torch.Tensor | None = None

    @property
    def num_kv_heads(self) -> int:
        return self.layers[0].self_attn.num_kv_heads

    @property
    def head_dim(self) -> int:
        return _cfg(self.config, "head_dim", self.config.hidden_size // self.config.num_attention_heads)

    def attach(self, target: LlamaForCausalLM) -> None:
        if target.config.hidden_size != self.config.hidden_size:
            raise ValueError(f"EAGLE head hidden_size {self.config.hidden_size} does not match the target's "
                             f"{target.config.hidden_size}")
        self.target = [target]
        self.set_draft_vocab(self.draft_vocab)

    def set_draft_vocab(self, token_ids: torch.Tensor | None) -> None:
        """Restrict drafting to ``token_ids`` (None: the whole vocabulary). Needs the target's
        LM head as a plain weight: attach before ``prepare_for_inference`` packs it."""
        self.draft_vocab = None if token_ids is None else token_ids.to(torch.long)
        self._vocab_weight = None
        if token_ids is not None and self.target and hasattr(self.target[0].lm_head, "weight_rows"):
            # a vocabulary-parallel LM head: every rank gathers the rows of the draft vocabulary
            lm_head = self.target[0].lm_head
            self.draft_vocab = self.draft_vocab.to(lm_head.linear.weight.device)
            self._vocab_weight = lm_head.weight_rows(self.draft_vocab).contiguous()
        elif token_ids is not None and self.target:
            weight = getattr(self.target[0].lm_head, "weight", None)
            if weight is None:
                raise ValueError("the target's LM head is already packed/quantized: attach the EAGLE head first")
            self.draft_vocab = self.draft_vocab.to(weight.device)
            self._vocab_weight = weight.detach()[self.draft_vocab].contiguous()

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata,
                features: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T] (the token at p + 1), features [T, H] (f_p; zeros when None: timing runs)
        -> predicted f_{p+1} [T, H]."""
        embeds = self.target[0].embed_tokens(input_ids)
        if features is None:
            features = torch.zeros_like(embeds)
        hidden = self.fc(torch.cat([embeds, features.to(embeds.dtype)], dim=-1))
        hidden, residual = self.layers[0](self.rotary.lookup(positions), hidden, None, kv_caches[0], meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._vocab_weight is None:
            return self.target[0].compute_logits(hidden)
        small = F.linear(hidden.to(self._vocab_weight.dtype), self._vocab_weight).float()  # [N, n]
        out = small.new_full((hidden.shape[0], self.target[0].config.vocab_size), float("-inf"))
        return out.index_copy_(1, self.draft_vocab, small)

    def load_weights(self, weights) -> None:
        """Hugging Face names (q/k/v, gate/up separate) -> the fused layer, through the Llama loader."""
        weights = list(weights)
        own = {n: t for n, t in weights if not n.startswith("layers.") and n != "draft_vocab"}
        vocab = [t for n, t in weights if n == "draft_vocab"]
        self.draft_vocab = vocab[0].to(torch.long) if vocab else None
        params = dict(self.named_parameters())
        for name, tensor in own.items():
            if name not in params:
                raise ValueError(f"unexpected weight {name!r} in the EAGLE head")
            params[name].data.copy_(tensor)
        shim = _LayerShim(self.layers, self.config)
        LlamaForCausalLM.load_weights(shim, [(n, t) for n, t in weights if n.startswith("layers.")])
        missing = {"fc.weight", "norm.weight"} - set(own)
        if missing:
            raise ValueError(f"EAGLE head weights missing: {sorted(missing)}")


class _LayerShim(nn.Module):
    """Just ``layers`` with the attributes LlamaForCausalLM.load_weights reads."""
    tie_word_embeddings = False
    _stacked = LlamaForCausalLM._stacked
    _load_shard = LlamaForCausalLM._load_shard

    def __init__(self, layers, config):
        super().__init__()
        self.layers = layers
        self.config = config


def hf_state_dict(head: EagleHead) -> dict[str, torch.Tensor]:
    """Parameters under Hugging Face Llama names (q/k/v and gate/up split), for saving."""
    out = {"fc.weight": head.fc.weight, "norm.weight": head.norm.weight}
    layer = head.layers[0]
    attn = layer.self_attn
    q, k, v = attn.qkv_proj.weight.split([attn.q_size, attn.kv_size, attn.kv_size])
    out.update({"layers.0.self_attn.q_proj.weight": q, "layers.0.self_attn.k_proj.weight": k,
                "layers.0.self_attn.v_proj.weight": v, "layers.0.self_attn.o_proj.weight": attn.o_proj.weight})
    gate, up = layer.mlp.gate_up_proj.weight.split(layer.mlp.intermediate_size)
    out.update({"layers.0.mlp.gate_proj.weight": gate, "layers.0.mlp.up_proj.weight": up,
                "layers.0.mlp.down_proj.weight": layer.mlp.down_proj.weight,
                "layers.0.input_layernorm.weight": layer.input_layernorm.weight,
                "layers.0.post_attention_layernorm.weight": layer.post_attention_layernorm.weight})
    out = {k: v.detach().contiguous() for k, v in out.items()}
    if head.draft_vocab is not None:
        out["draft_vocab"] = head.draft_vocab.detach().cpu().contiguous()
    return out


def head_config(target_config, intermediate_size: int | None = None):
    """The head's layer shape: the target's attention and width, its MLP (or a given width)."""
    from transformers import LlamaConfig

    heads = target_config.num_attention_heads
    theta, scaling = _rope_params(target_config)
    return LlamaConfig(
        hidden_size=target_config.hidden_size, num_attention_heads=heads,
        num_key_value_heads=_cfg(target_config, "num_key_value_heads", heads),
        head_dim=_cfg(target_config, "head_dim", target_config.hidden_size // heads),
        intermediate_size=intermediate_size or target_config.intermediate_size, num_hidden_layers=1,
        vocab_size=target_config.vocab_size, max_position_embeddings=target_config.max_position_embeddings,
        rms_norm_eps=_cfg(target_config, "rms_norm_eps", 1e-6), rope_theta=theta,
        rope_scaling=scaling, hidden_act="silu", tie_word_embeddings=False)


def save_head(head: EagleHead, out: Path, extra: dict | None = None) -> None:
    """Atomic: written to a temporary folder, then swapped in."""
    import shutil

    from safetensors.torch import save_file

    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = head.config.to_dict()
    config.update(architectures=["SpecdecEagleHead"], torch_dtype="bfloat16",
                  **{EAGLE_KEY: {"target_hidden_size": head.config.hidden_size, **(extra or {})}})
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v if not v.is_floating_point() else v.to(torch.bfloat16) for k, v in hf_state_dict(head).items()},
              str(tmp / "model.safetensors"))
    if out.exists():
        shutil.rmtree(out)
    tmp.replace(out)


def load_head(path: str | Path, target: LlamaForCausalLM, dtype: torch.dtype, device, attn_backend) -> EagleHead:
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    raw.pop(EAGLE_KEY)
    config = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "torch_dtype", "dtype")})
    head = EagleHead(config, attn_backend)
    head.load_weights(load_file(str(path / "model.safetensors")).items())
    head = head.to(device=device, dtype=dtype).eval()
    head.rotary.reset_tables()
    head.attach(target)
    return head


def dense_forward(head: EagleHead, input_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """Training / reference form: ``input_ids`` [B, S] (token p + 1 at column p), ``features``
    [B, S, H] (f_p) -> predicted f_{p+1} [B, S, H], causal attention within each row, no KV cache.
    The same modules as the paged path, with the layer's attention swapped for dense SDPA."""
    from types import SimpleNamespace

    from specdec.layers.attention import AttentionBackend

    b, s = input_ids.shape
    attn = head.layers[0].self_attn
    kv: dict[str, torch.Tensor] = {}

    def write(k, v, cache, slots):
        kv["k"], kv["v"] = k, v

    def attend(q, cache, meta, scale):
        def heads(x):  # [B*S, h, D] -> [B, h, S, D]
            return x.view(b, s, x.shape[1], x.shape[2]).transpose(1, 2)

        rep = attn.num_heads // attn.num_kv_heads
        k, v = (heads(kv[n]).repeat_interleave(rep, dim=1) for n in ("k", "v"))
        out = F.scaled_dot_product_attention(heads(q), k, v, is_causal=True, scale=scale)
        return out.transpose(1, 2).reshape(b * s, attn.num_heads, attn.head_dim)

    saved, attn.backend = attn.backend, AttentionBackend("dense", write, attend)
    try:
        positions = torch.arange(s, device=input_ids.device).repeat(b)
        meta = SimpleNamespace(slot_mapping=None)  # nothing is cached
        out = head(input_ids.reshape(-1), positions, [None], meta, features=features.reshape(b * s, -1))
    finally:
        attn.backend = saved
    return out.view(b, s, -1)


def init_head(target: LlamaForCausalLM, intermediate_size: int | None = None, seed: int = 0) -> EagleHead:
    """A fresh head for ``target`` (float32, on the target's device): small random weights, its
    layer's norms at one, fc starting as "pass the feature through" so the untrained head already
    predicts f_{p+1} ~ f_p."""
    from specdec.layers.attention import TORCH_BACKEND

    config = head_config(target.config, intermediate_size)
    gen = torch.Generator().manual_seed(seed)
    head = EagleHead(config, TORCH_BACKEND)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        hidden = config.hidden_size
        head.fc.weight[:, hidden:] += torch.eye(hidden)
    head.attach(target)
    return head.to(next(target.parameters()).device)
