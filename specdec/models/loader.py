"""Load a model folder: config.json + safetensors (single or sharded) -> a specdec model."""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from specdec.layers.attention import TORCH_BACKEND, AttentionBackend
from specdec.layers.rotary import RotaryEmbedding
from specdec.models.gguf_quant import install_quantized_linears, load_quantized_linears
from specdec.models.registry import get_model_class


def resolve_model_path(model: str) -> str:
    """A local folder, a GGUF file or a registry name (pulled on first use) -> a local HF folder."""
    try:
        from specdec.models.hub import resolve_model
    except ImportError:  # hub not available: plain folders only
        resolve_model = None
    if os.path.isdir(model):
        return model
    if resolve_model is not None:
        try:
            return str(resolve_model(model))
        except FileNotFoundError as e:  # a user error like any other bad argument: one ValueError
            raise ValueError(str(e)) from None
    raise ValueError(f"model path {model!r} does not exist")


def load_config(path: str):
    from transformers import AutoConfig

    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"model folder {path!r} has no config.json")
    try:
        config = AutoConfig.from_pretrained(path)
    except (ValueError, KeyError) as e:
        model_type = json.loads(config_file.read_text()).get("model_type")
        raise ValueError(f"cannot read config.json in {path!r} (model_type={model_type!r}): {e}") from None
    get_model_class(config)  # unknown architecture -> clear error before any weight is read
    return config


def safetensors_files(path: str) -> list[Path]:
    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / f for f in sorted(set(weight_map.values()))]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model folder {path!r} has no *.safetensors weights")
    for f in files:
        if not f.is_file():
            raise ValueError(f"weight shard {str(f)!r} listed in model.safetensors.index.json is missing")
    return files


def iterate_weights(path: str, slicer=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every checkpoint weight; with ``slicer`` (tensor parallelism) only this
    rank's slice of each is read."""
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, (f.get_tensor(name) if slicer is None else slicer.read(name, f.get_slice(name)))


def load_model(path: str, dtype: torch.dtype, device: torch.device, attn_backend: AttentionBackend = TORCH_BACKEND,
               config=None, tp=None):
    """``tp``: a ``TensorParallelGroup``; the model is built, read and wired as this rank's shard."""
    config = config or load_config(path)
    cls = get_model_class(config)
    torch_default = torch.get_default_dtype()
    slicer = None
    try:
        torch.set_default_dtype(dtype)
        with torch.device("meta"):  # no random init: every weight is overwritten by the checkpoint
            model = cls(config, attn_backend=attn_backend)
            if tp is not None and tp.world_size > 1:
                from specdec.distributed.tensor_parallel import ShardSlicer, shard_shapes

                shard_shapes(model, tp)
                slicer = ShardSlicer(model.tensor_parallel_split)
    finally:
        torch.set_default_dtype(torch_default)
    model = model.to_empty(device=device)
    if model.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    quantized = load_quantized_linears(path)  # GGUF Q8_0 / Q4_0 linears, kept in their blocks
    if quantized:
        if slicer is not None:
            raise ValueError(f"{path!r} keeps GGUF-quantized linears, which tensor parallelism does not shard yet")
        install_quantized_linears(model, quantized, dtype, device)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_tables()
    model.load_weights(iterate_weights(path, slicer))
    if slicer is not None:
        from specdec.distributed.tensor_parallel import wrap_collectives

        wrap_collectives(model, tp)
    return model.eval().requires_grad_(False)
