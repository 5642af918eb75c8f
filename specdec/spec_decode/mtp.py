"""``"method": "mtp"``: the target's own multi-token-prediction layer drafts (DeepSeek-V3 / R1
layout), with no draft checkpoint. Registered in ``methods.py``; its parts are ``validate``,
``plan_draft``, ``load`` and ``build`` here.

The checkpoint keeps them as ``model.layers.{num_hidden_layers + i}`` (``num_nextn_predict_layers``
in the config), each: ``enorm``, ``hnorm``, ``eh_proj`` [H, 2H], one decoder block (MLA and MoE, as the
target's) and ``shared_head.norm`` (its ``embed_tokens`` and ``shared_head.head`` repeat the
target's, which are used instead). Row p reads the target's final hidden state h_p and the token
at p + 1: ``x = eh_proj([enorm(embed(t_{p+1})), hnorm(h_p)])``, the block, and the target's LM
head after ``shared_head.norm`` gives the token at p + 2, exactly the EAGLE head's contract, so
the EAGLE proposer (catch-up on real features, then passes fed their own predicted states;
chains and trees) drives it. With ``num_nextn_predict_layers`` n, draft position i (1-based) is
drafted by layer min(i, n) - 1: K above n chains the last layer (vLLM cycles through the layers
instead). Its KV cache has the target's latent layout, one layer per MTP layer.
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
    """The target's ``num_nextn_predict_layers`` MTP layers as an EAGLE-style head: forward(...,
    features=h) -> a layer's output state [T, H] (fed back as the next pass's features);
    ``compute_logits`` normalises it with that layer's ``shared_head.norm`` and applies the
    target's LM head. ``draft_pass`` (set by ``MTPProposer`` before each forward) picks the layer:
    pass i >= 1 runs layer min(i, n - 1); pass 0, the catch-up on the target's real states, runs
    layer 0 and then chains every further layer j over the same rows, row p reading layer j-1's
    state at row p - 1 (the request's first row: the target's state), which is what pass j feeds
    it at drafting time, so each layer's cache holds its own states at the real positions."""

    def __init__(self, target: DeepseekV3ForCausalLM):
        super().__init__()
        config = copy.copy(target.config)
        num_layers = int(_cfg(config, "num_nextn_predict_layers", 1) or 1)
        config.num_hidden_layers = num_layers  # this head's own cache: one layer per MTP layer
        self.config = config
        hidden, eps = config.hidden_size, _cfg(config, "rms_norm_eps", 1e-6)
        first = target.config.num_hidden_layers
        self.enorm = nn.ModuleList([RMSNorm(hidden, eps) for _ in range(num_layers)])
        self.hnorm = nn.ModuleList([RMSNorm(hidden, eps) for _ in range(num_layers)])
        self.eh_proj = nn.ModuleList([nn.Linear(2 * hidden, hidden, bias=False) for _ in range(num_layers)])
        self.layers = nn.ModuleList([DeepseekDecoderLayer(target.config, first + i, target.router_class)
                                     for i in range(num_layers)])
        self.shared_head_norm = nn.ModuleList([RMSNorm(hidden, eps) for _ in range(num_layers)])
        self.target = [target]  # a list so the target is not a submodule
        self.draft_pass = 0

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return self.target[0].kv_cache_shape(num_blocks, block_size)

    def _layer(self, i: int, embeds, features, rope, kv_cache, meta) -> torch.Tensor:  # [T, H]
        hidden = self.eh_proj[i](torch.cat([self.enorm[i](embeds), self.hnorm[i](features)], dim=-1))
        out, residual = self.layers[i](rope, hidden, None, kv_cache, meta)
        return out + residual

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata,
                features: torch.Tensor | None = None) -> torch.Tensor:
        target = self.target[0]
        embeds = target.embed_tokens(input_ids)
        features = torch.zeros_like(embeds) if features is None else features.to(embeds.dtype)
        rope = target.rope_rows(positions, meta)
        if self.draft_pass > 0:
            i = self._pass_layer()
            return self._layer(i, embeds, features, rope, kv_caches[i], meta)
        out = state = self._layer(0, embeds, features, rope, kv_caches[0], meta)
        firsts = meta.query_start_loc[:-1]
        for j in range(1, self.num_layers):
            shifted = torch.cat([features[:1], state[:-1]])
            shifted[firsts] = features[firsts]
            state = self._layer(j, embeds, shifted, rope, kv_caches[j], meta)
        return out

    def _pass_layer(self) -> int:
        return min(self.draft_pass, self.num_layers - 1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target[0].compute_logits(self.shared_head_norm[self._pass_layer()](hidden))

    def load_weights(self, weights) -> None:
        """The checkpoint's ``model.layers.{num_hidden_layers + i}.*`` (other names are ignored)."""
        first = self.target[0].config.num_hidden_layers
        prefixes = [f"layers.{first + i}." for i in range(self.num_layers)]
        own, block = {}, []
        for name, tensor in weights:
            name = name.removeprefix("model.")
            i = next((i for i, p in enumerate(prefixes) if name.startswith(p)), None)
            if i is None:
                continue
            name = name[len(prefixes[i]):]
            if name.startswith(("enorm.", "hnorm.", "eh_proj.")):
                part, rest = name.split(".", 1)
                own[f"{part}.{i}.{rest}"] = tensor
            elif name == "shared_head.norm.weight":
                own[f"shared_head_norm.{i}.weight"] = tensor
            elif not name.startswith(("embed_tokens.", "shared_head.head.")):
                block.append((f"layers.{i}.{name}", tensor))
        if not own and not block:
            raise ValueError(f"the target checkpoint has no MTP layer (model.{prefixes[0]}*): method 'mtp' needs a "
                             f"checkpoint with num_nextn_predict_layers >= 1 and its weights")
        params = dict(self.named_parameters())
        for i, prefix in enumerate(prefixes):
            for name in ("enorm", "hnorm", "eh_proj", "shared_head_norm"):
                key = f"{name}.{i}.weight"
                if key not in own:
                    raise ValueError(f"the target's MTP layer is missing model.{prefix}"
                                     f"{name.replace('_norm', '.norm')}.weight")
                params[key].data.copy_(own[key])
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
    """The EAGLE proposer, telling the head which pass each forward is (``MTPHead.draft_pass``):
    0 for the catch-up, then the draft step (chains) or the tree depth (trees)."""
    name = "mtp"

    def __init__(self, runner, target_vocab_size: int, **tree):
        super().__init__(runner, target_vocab_size, **tree)
        self._num_passes = 0  # during a proposal: the forwards run so far

    def propose(self, *args, **kwargs):
        self._num_passes = 0
        try:
            return super().propose(*args, **kwargs)
        finally:
            self._num_passes = self.runner.model.draft_pass = 0

    def _forward(self, batch):
        self.runner.model.draft_pass = self._num_passes
        self._num_passes += 1
        return super()._forward(batch)


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
    from specdec.spec_decode.methods import _draft_args

    return MTPProposer(runner, vocab_size, **_draft_args(spec))

