"""Random checkpoints for benchmarks: speed does not depend on weight values.

``make_random_llama(DIR, preset="tinyllama-1.1b")`` writes a TinyLlama-1.1B-shaped Llama in
bf16 (the size at which weights dominate a CPU decode step).

A plain random init has nearly flat next-token logits: the top two of 32000 often differ
by less than one bf16 step, so greedy decoding flips between batch shapes (a 1-row decode
and a K+1-row verification round differently) and a replay reference stops matching the
output. ``predictable=True`` (the default) keeps the random init but makes greedy robust:
the embedding dominates the residual stream (layer outputs scaled by ``layer_scale``) and
the lm_head is a row permutation of the embedding, so each token has one fixed successor
whose logit leads by a wide margin. Every matmul, attention and KV read is the same size
as in the real model, so speed is unchanged.

``make_layer_skip_draft`` writes a draft made of the target's first N layers plus its
embeddings, final norm and lm_head; ``corrupt_fraction`` shuffles that fraction of the
draft's lm_head rows, so the draft guesses wrong on about that fraction of tokens: a model
pair with a chosen acceptance and no download.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

PRESETS = {
    # TinyLlama-1.1B: 1.10 B parameters, 2.2 GB in bf16
    "tinyllama-1.1b": dict(hidden_size=2048, num_layers=22, num_heads=32, num_kv_heads=4,
                           intermediate_size=5632, vocab_size=32000, max_position_embeddings=2048),
    # a quick stand-in for tests and smoke runs
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                 vocab_size=320, max_position_embeddings=1024),
}


def make_random_llama(out_dir: str | Path, preset: str = "tinyllama-1.1b", dtype: str = "bfloat16",
                      seed: int = 0, predictable: bool = True, layer_scale: float = 0.01, **overrides) -> Path:
    """A random Llama checkpoint (config + safetensors + a small byte-level BPE tokenizer)."""
    import transformers

    from specdec.models.tiny import make_tokenizer

    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    shape = {**PRESETS[preset], **overrides}
    tokenizer = make_tokenizer(min(shape["vocab_size"], 320))
    config = transformers.LlamaConfig(
        vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"], num_hidden_layers=shape["num_layers"],
        num_attention_heads=shape["num_heads"], num_key_value_heads=shape["num_kv_heads"],
        max_position_embeddings=shape["max_position_embeddings"], tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch_dtype = getattr(torch, dtype)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch_dtype)
        model = transformers.LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        if predictable:
            embed = model.model.embed_tokens.weight
            embed.normal_(0.0, 1.0)
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(layer_scale)
                layer.mlp.down_proj.weight.mul_(layer_scale)
            successor = torch.randperm(embed.shape[0])  # logit j peaks where successor[j] is the current token
            model.lm_head.weight.copy_(embed[successor])
        else:  # larger logits than the default init
            model.lm_head.weight.mul_(8.0)
    model.config.dtype = dtype
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    return out


def make_layer_skip_draft(target_dir: str | Path, out_dir: str | Path, num_layers: int = 1,
                          corrupt_fraction: float = 0.0, seed: int = 0) -> Path:
    """Copy the target's first ``num_layers`` layers plus embeddings, norm and lm_head."""
    if not 0.0 <= corrupt_fraction <= 1.0:
        raise ValueError(f"corrupt_fraction must be in [0, 1], got {corrupt_fraction}")
    from safetensors import safe_open
    from safetensors.torch import save_file

    from specdec.models.loader import safetensors_files

    target, out = Path(target_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((target / "config.json").read_text())
    if not 1 <= num_layers <= config["num_hidden_layers"]:
        raise ValueError(f"num_layers must be in 1..{config['num_hidden_layers']}, got {num_layers}")
    tensors = {}
    for file in safetensors_files(str(target)):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                parts = name.split(".")
                if "layers" in parts and int(parts[parts.index("layers") + 1]) >= num_layers:
                    continue
                tensors[name] = f.get_tensor(name)
    if corrupt_fraction > 0:
        head = tensors["lm_head.weight"].clone()
        gen = torch.Generator().manual_seed(seed)
        rows = torch.randperm(head.shape[0], generator=gen)[: int(corrupt_fraction * head.shape[0])]
        head[rows] = head[rows[torch.randperm(len(rows), generator=gen)]]
        tensors["lm_head.weight"] = head
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja"):
        if (target / name).is_file():
            (out / name).write_bytes((target / name).read_bytes())
    return out
