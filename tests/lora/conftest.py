"""PEFT-format adapters for the tiny checkpoints, written with safetensors directly (the
layout ``peft.save_pretrained`` writes), and the merged-weights oracle built with transformers."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

PEFT_PREFIX = "base_model.model.model.layers"
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(out: Path, model_path: str, targets=ALL_TARGETS, rank: int = 4, alpha: float = 8.0,
                  seed: int = 0, use_rslora: bool = False, magnitude: float = 0.3, config_extra: dict | None = None,
                  tensors_extra: dict | None = None) -> str:
    """A random adapter (B non-zero, unlike a fresh PEFT one, so it changes the output)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from specdec.lora.adapter import module_shapes

    cfg = AutoConfig.from_pretrained(model_path)
    shapes = module_shapes(cfg)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for module in targets:
            owner = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            in_f, out_f = shapes[module]
            key = f"{PEFT_PREFIX}.{layer}.{owner}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * magnitude
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * magnitude
    tensors.update(tensors_extra or {})
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
              "use_rslora": use_rslora, "fan_in_fan_out": False, "bias": "none", "lora_dropout": 0.0,
              "task_type": "CAUSAL_LM", "base_model_name_or_path": model_path, **(config_extra or {})}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return str(out)


def merged_hf_model(model_path: str, adapter_path: str | None):
    """transformers' model with W + scale * B @ A merged into every adapted linear (float32)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    if adapter_path is None:
        return model
    config = json.loads((Path(adapter_path) / "adapter_config.json").read_text())
    tensors = load_file(str(Path(adapter_path) / "adapter_model.safetensors"))
    r = config["r"]
    scale = config["lora_alpha"] / (math.sqrt(r) if config.get("use_rslora") else r)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for key, a in tensors.items():
            if ".lora_A." not in key:
                continue
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            modules[name].weight += scale * (b @ a)
    return model


def hf_greedy(model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Argmax decoding with the full forward each token (EOS is just a token, as with ignore_eos)."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(max_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


@pytest.fixture(scope="session")
def adapters(llama_path, tmp_path_factory) -> dict[str, str]:
    """Two adapters of the default target: every module at rank 4, and q/v only at rank 8 with rsLoRA."""
    root = tmp_path_factory.mktemp("adapters")
    return {"all": write_adapter(root / "all", llama_path, seed=1),
            "qv": write_adapter(root / "qv", llama_path, targets=("q_proj", "v_proj"), rank=8, alpha=16.0,
                                seed=2, use_rslora=True, magnitude=0.5)}
