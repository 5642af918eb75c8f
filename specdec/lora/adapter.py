"""A PEFT LoRA checkpoint, read and validated against the model it will adapt.

On disk (PEFT's format): ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``,
``use_rslora``, ``bias``) and ``adapter_model.safetensors`` with, per adapted linear,
``base_model.model.model.layers.{i}.{self_attn|mlp}.{name}.lora_A.weight`` [r, in] and
``...lora_B.weight`` [out, r]. The adapted linear computes ``W x + scale * B (A x)`` with
``scale = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA).

Everything that could make a step fail is checked here, when the adapter is loaded: each
problem is a ``ValueError`` naming the adapter and the field or tensor.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.lora.request import LoRARequest

# PEFT module name -> (the model's fused linear, the part of its output it fills)
TARGET_MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0),
}
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)"
                  r"\.lora_([AB])(?:\.default)?\.weight$")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass
class LoRAAdapter:
    name: str
    adapter_id: int
    path: str
    rank: int  # the largest rank of its modules
    # (layer index, PEFT module name) -> (A [r, in], scale * B [out, r]), float32 on the CPU
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def module_shapes(model_config) -> dict[str, tuple[int, int]]:
    """PEFT module name -> (in_features, out_features) of the whole (unsharded) linear."""
    hidden = model_config.hidden_size
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    head_dim = getattr(model_config, "head_dim", None) or hidden // heads
    inter = model_config.intermediate_size
    q, kv = heads * head_dim, kv_heads * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def load_adapter(request: LoRARequest, model_config, max_lora_rank: int) -> LoRAAdapter:
    where = f"LoRA adapter {request.lora_name!r} ({request.lora_path})"
    folder = Path(request.lora_path)
    if not folder.is_dir():
        raise ValueError(f"{where}: lora_path is not a folder")
    config = _read_config(folder / CONFIG_FILE, where, max_lora_rank)
    tensors = _read_tensors(folder / WEIGHTS_FILE, where)
    shapes = module_shapes(model_config)
    num_layers = model_config.num_hidden_layers
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"{where}: tensor {key!r} is not a LoRA A/B weight of a layer's "
                             f"{'/'.join(TARGET_MODULES)} (embeddings, LM head, biases, DoRA are not supported)")
        layer, module, which = int(match[1]), match[2], match[3]
        if module not in TARGET_MODULES:
            raise ValueError(f"{where}: tensor {key!r} targets module {module!r}, which the model lacks "
                             f"(adaptable: {sorted(TARGET_MODULES)})")
        if layer >= num_layers:
            raise ValueError(f"{where}: tensor {key!r} targets layer {layer}; the model has {num_layers} layers")
        pairs.setdefault((layer, module), {})[which] = tensor
    if not pairs:
        raise ValueError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    weights = {}
    for (layer, module), ab in sorted(pairs.items()):
        name = f"layers.{layer}.{module}"
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: {name} has lora_{''.join(ab)} but not lora_{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"].float(), ab["B"].float()
        in_features, out_features = shapes[module]
        rank = a.shape[0] if a.dim() == 2 else -1
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or tuple(b.shape) != (out_features, rank):
            raise ValueError(f"{where}: {name} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; the model "
                             f"needs [r, {in_features}] and [{out_features}, r]")
        if not 1 <= rank <= max_lora_rank:
            raise ValueError(f"{where}: {name} has rank {rank}, over max_lora_rank {max_lora_rank}")
        if not config["rank_pattern"] and rank != config["r"]:
            raise ValueError(f"{where}: {name} has rank {rank}, but adapter_config.json says r = {config['r']}")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise ValueError(f"{where}: {name} has non-finite (inf / nan) weights")
        alpha = config["lora_alpha"]
        scale = alpha / math.sqrt(rank) if config["use_rslora"] else alpha / rank
        weights[(layer, module)] = (a.contiguous(), (b * scale).contiguous())
    return LoRAAdapter(request.lora_name, request.lora_int_id, request.lora_path,
                       max(a.shape[0] for a, _ in weights.values()), weights)


def _read_config(file: Path, where: str, max_lora_rank: int) -> dict:
    if not file.is_file():
        raise ValueError(f"{where}: no {CONFIG_FILE} in the folder")
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: {CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: {CONFIG_FILE} must hold a JSON object")
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type is {raw['peft_type']!r}; only LORA adapters load")
    r = raw.get("r", 8)
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"{where}: r must be a positive integer, got {r!r}")
    if r > max_lora_rank:
        raise ValueError(f"{where}: r = {r} is over max_lora_rank {max_lora_rank} (raise max_lora_rank)")
    alpha = raw.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ValueError(f"{where}: lora_alpha must be a finite number, got {alpha!r}")
    if raw.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias is {raw['bias']!r}; only bias 'none' is supported")
    if raw.get("use_dora"):
        raise ValueError(f"{where}: use_dora is set; DoRA adapters are not supported")
    if raw.get("modules_to_save"):
        raise ValueError(f"{where}: modules_to_save {raw['modules_to_save']!r} is not supported (the adapter "
                         f"would replace whole modules)")
    if raw.get("alpha_pattern"):
        raise ValueError(f"{where}: alpha_pattern is not supported")
    targets = raw.get("target_modules")
    if isinstance(targets, list):
        unknown = [t for t in targets if t not in TARGET_MODULES]
        if unknown:
            raise ValueError(f"{where}: target_modules {unknown} are not modules this model can adapt "
                             f"(adaptable: {sorted(TARGET_MODULES)})")
    # fan_in_fan_out only transposes Conv1D weights (GPT-2); PEFT ignores it for nn.Linear targets
    return {"r": r, "lora_alpha": float(alpha), "use_rslora": bool(raw.get("use_rslora", False)),
            "rank_pattern": raw.get("rank_pattern") or {}}


def _read_tensors(file: Path, where: str) -> dict[str, torch.Tensor]:
    if not file.is_file():
        raise ValueError(f"{where}: no {WEIGHTS_FILE} in the folder (adapters load from safetensors only)")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{where}: {WEIGHTS_FILE} cannot be read: {e}") from None
