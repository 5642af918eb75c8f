"""``"method": "mtp"``: the target's own multi-token-prediction layer drafts (DeepSeek-V3 / R1
layout), with no draft checkpoint. Registered in ``methods.py``; its parts are ``validate``,
``plan_draft``, ``load`` and ``build`` here.

The checkpoint keeps it as ``model.layers.{num_hidden_layers}`` (``num_nextn_predict_layers`` in
the config): ``enorm``, ``hnorm``, ``eh_proj`` [H, 2H], one decoder block (MLA and MoE, as the
target's) and ``shared_head.norm`` (its ``embed_tokens`` and ``shared_head.head`` repeat the
target's, which are used instead). Row p reads the target's final hidden state h_p and the token
at p + 1: ``x = eh_proj([enorm(embed(t_{p+1})), hnorm(h_p)])``, the block, and the target's LM
head after ``shared_head.norm`` gives the token at p + 2, exactly the EAGLE head's contract, so
the EAGLE proposer (catch-up on real features, then passes fed their own predicted states;
chains and trees) drives it. Drafting K above the number of MTP layers chains the layer (only the
first MTP layer is read). Its KV cache has the target's latent layout, one layer.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from specdec.layers.attention import AttentionMetadata
from specdec.layers.norm import RMSNorm
from specdec.models.deepseek_v3 import DeepseekDecoderLayer, DeepseekV3ForCausalLM
from specdec.models.llama import _cfg
from specdec.spec_decode.eagle import EagleProposer
from specdec.spec_decode.methods import DraftLoad, DraftParts


class MTPHead(nn.Module):
    """One MTP layer of ``target`` as an EAGLE-style head: forward(..., features=h) -> the layer's
    output state [T, H] (fed back as the next pass's features); ``compute_logits`` normalises it
    with ``shared_head.norm`` and applies the target's LM head."""

    def __init__(self, target: DeepseekV3ForCausalLM):
        super().__init__()
        config = copy.copy(target.config)
        config.num_hidden_layers = 1  # this head's own cache: one layer
        self.config = config
        hidden, eps = config.hidden_size, _cfg(config, "rms_norm_eps", 1e-6)
        self.enorm, self.hnorm = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([DeepseekDecoderLayer(target.config, target.config.num_hidden_layers,
                                                         target.router_class)])
        self.shared_head_norm = RMSNorm(hidden, eps)
        self.target = [target]  # a list so the target is not a submodule

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return self.target[0].kv_cache_shape(num_blocks, block_size)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata,
                features: torch.Tensor | None = None) -> torch.Tensor:
        target = self.target[0]
        embeds = target.embed_tokens(input_ids)
        features = torch.zeros_like(embeds) if features is None else features.to(embeds.dtype)
        hidden = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(features)], dim=-1))
        out, residual = self.layers[0](target.rope_rows(positions, meta), hidden, None, kv_caches[0], meta)
        return out + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target[0].compute_logits(self.shared_head_norm(hidden))

    def load_weights(self, weights) -> None:
        """The checkpoint's ``model.layers.{num_hidden_layers}.*`` (other names are ignored)."""
        prefix = f"layers.{self.target[0].config.num_hidden_layers}."
        own, block = {}, []
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if not name.startswith(prefix):
                continue
            name = name[len(prefix):]
            if name.startswith(("enorm.", "hnorm.", "eh_proj.")):
                own[name] = tensor
            elif name == "shared_head.norm.weight":
                own["shared_head_norm.weight"] = tensor
            elif not name.startswith(("embed_tokens.", "shared_head.head.")):
                block.append((f"layers.0.{name}", tensor))
        if not own and not block:
            raise ValueError(f"the target checkpoint has no MTP layer (model.{prefix}*): method 'mtp' needs a "
                             f"checkpoint with num_nextn_predict_layers >= 1 and its weights")
        params = dict(self.named_parameters())
        for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head_norm.weight"):
            if name not in own:
                raise ValueError(f"the target's MTP layer is missing {prefix}{name.replace('_norm', '.norm')}")
            params[name].data.copy_(own[name])
        _BlockShim(self.layers, self.config, self.target[0].rope_interleave).load_weights(block)


class _BlockShim(nn.Module):
    """Just ``layers`` with what ``DeepseekV3ForCausalLM.load_weights`` reads."""
    tie_word_embeddings = False
    load_weights = DeepseekV3ForCausalLM.load_weights
    _param = DeepseekV3ForCausalLM._param
    _deinterleave_rope = DeepseekV3ForCausalLM._deinterleave_rope

    def __init__(self, layers: nn.ModuleList, config, rope_interleave: bool):
        super().__init__()
        self.layers, self.config, self.rope_interleave = layers, config, rope_interleave


class MTPProposer(EagleProposer):
    name = "mtp"


def validate(spec) -> None:
    if spec.model:
        raise ValueError(f"speculative_config.model must be unset for method 'mtp' (the target's own MTP layers "
                         f"draft), got {spec.model!r}")


def plan_draft(spec, cfg, target, device):
    from specdec.worker.plan import WeightPlan

    return WeightPlan(target.compute_dtype, target.compute_dtype, spec.quantization, None)


def load(load: DraftLoad) -> DraftParts:
    from specdec.layers.quantization import prepare_for_inference
    from specdec.models.loader import iterate_weights, resolve_model_path
    from specdec.worker.model_runner import ModelRunner

    target = load.target
    if not isinstance(target, DeepseekV3ForCausalLM) or not _cfg(target.config, "num_nextn_predict_layers", 0):
        raise ValueError(f"method 'mtp' needs a target with MTP layers (DeepSeek-V3 layout, num_nextn_predict_layers "
                         f">= 1); {type(target).__name__} has none")
    dtype = load.weights.compute_dtype
    with torch.device(load.device):
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            head = MTPHead(target)
        finally:
            torch.set_default_dtype(default)
    head.load_weights(iterate_weights(resolve_model_path(load.cfg.model)))
    head = prepare_for_inference(head.eval().requires_grad_(False), load.weights.quantization, load.device)
    return DraftParts(head, dtype, ModelRunner.kv_bytes_per_block(head.config, load.cfg.block_size, dtype))


def build(spec, runner, vocab_size, parts: DraftParts):
    from specdec.spec_decode.methods import _tree_args

    return MTPProposer(runner, vocab_size, **_tree_args(spec))

