"""PEFT adapter validation: every problem is a ValueError naming the adapter and the field or
tensor, raised when the adapter is loaded (before any step)."""
from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoConfig

from specdec.lora.adapter import load_adapter
from specdec.lora.request import LoRARequest
from tests.lora.conftest import PEFT_PREFIX, write_adapter


@pytest.fixture(scope="module")
def config(llama_path):
    return AutoConfig.from_pretrained(llama_path)


def _load(path, config, max_rank=16):
    return load_adapter(LoRARequest("ad", 1, str(path)), config, max_rank)


def test_scaling_and_targets(llama_path, config, tmp_path):
    plain = _load(write_adapter(tmp_path / "p", llama_path, targets=("q_proj", "down_proj"), rank=4, alpha=8), config)
    rs = _load(write_adapter(tmp_path / "r", llama_path, targets=("q_proj",), rank=4, alpha=8, use_rslora=True), config)
    assert sorted({m for _, m in plain.weights}) == ["down_proj", "q_proj"] and plain.rank == 4
    from safetensors.torch import load_file

    raw = load_file(str(tmp_path / "p" / "adapter_model.safetensors"))
    b = raw[f"{PEFT_PREFIX}.1.mlp.down_proj.lora_B.weight"]
    torch.testing.assert_close(plain.weights[(1, "down_proj")][1], b * (8 / 4))
    raw = load_file(str(tmp_path / "r" / "adapter_model.safetensors"))
    torch.testing.assert_close(rs.weights[(0, "q_proj")][1],
                               raw[f"{PEFT_PREFIX}.0.self_attn.q_proj.lora_B.weight"] * (8 / math.sqrt(4)))


BAD = {
    "rank over max_lora_rank": (dict(rank=32), "over max_lora_rank 16"),
    "unknown target in config": (dict(config_extra={"target_modules": ["q_proj", "embed_tokens"]}),
                                 r"target_modules \['embed_tokens'\]"),
    "bias": (dict(config_extra={"bias": "all"}), "bias is 'all'"),
    "dora": (dict(config_extra={"use_dora": True}), "use_dora"),
    "rank disagrees with r": (dict(config_extra={"r": 2}), "adapter_config.json says r = 2"),
    "layer the model lacks": (dict(tensors_extra={f"{PEFT_PREFIX}.7.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64),
                                                  f"{PEFT_PREFIX}.7.self_attn.q_proj.lora_B.weight": torch.zeros(64, 4)}),
                              "targets layer 7; the model has 2 layers"),
    "module the model lacks": (dict(tensors_extra={f"{PEFT_PREFIX}.0.mlp.fc1.lora_A.weight": torch.zeros(4, 64)}),
                               "targets module 'fc1', which the model lacks"),
    "embedding": (dict(tensors_extra={"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 8)}),
                  "not a LoRA A/B weight"),
    "shape": (dict(tensors_extra={f"{PEFT_PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 48)}),
              r"layers.0.q_proj has lora_A \(4, 48\)"),
    "nan": (dict(tensors_extra={f"{PEFT_PREFIX}.1.mlp.up_proj.lora_B.weight": torch.full((128, 4), float("nan"))}),
            "layers.1.up_proj has non-finite"),
    "lone A": (dict(targets=(), tensors_extra={f"{PEFT_PREFIX}.0.mlp.up_proj.lora_A.weight": torch.zeros(4, 64)}),
               "has lora_A but not lora_B"),
    "empty": (dict(targets=()), "holds no LoRA weights"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_invalid_adapters_name_the_problem(case, llama_path, config, tmp_path):
    kwargs, message = BAD[case]
    path = write_adapter(tmp_path / "bad", llama_path, **kwargs)
    with pytest.raises(ValueError, match=message) as info:
        _load(path, config)
    assert "LoRA adapter 'ad'" in str(info.value)


def test_missing_and_unreadable_files(llama_path, config, tmp_path):
    path = write_adapter(tmp_path / "a", llama_path)
    (tmp_path / "a" / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="cannot be read"):
        _load(path, config)
    (tmp_path / "a" / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match="no adapter_model.safetensors"):
        _load(path, config)
    (tmp_path / "a" / "adapter_config.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        _load(path, config)
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3"}))
    with pytest.raises(ValueError, match="only LORA"):
        _load(path, config)
