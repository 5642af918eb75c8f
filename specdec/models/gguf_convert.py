"""GGUF file -> plain Hugging Face folder (bf16 `model.safetensors`, config, tokenizer, EOS ids).

The heavy lifting is transformers' own GGUF support and the `gguf` package, not hand-written
dequantization: `gguf` dequantizes every ggml type, transformers' tensor processors map llama.cpp
tensor names to transformers names, undo llama.cpp's Q/K row permutation of Llama attention
weights and stack MoE experts; `AutoConfig` / `AutoTokenizer` with `gguf_file=` rebuild the config
and a fast tokenizer from the metadata. This file adds what they leave out: a meta-device model to
name the tensors (so no `accelerate` and no fp32 copy of the whole model), a tensor-by-tensor read
that never dequantizes a kept tensor, per-expert checkpoint names, a completeness check,
two tokenizer fixes that make the rebuilt tokenizer match the upstream `tokenizer.json`, and a
`generation_config.json` with every end-of-generation id llama.cpp would stop on.

With `keep_quantized` (the default), Q8_0, Q5_0, Q6_K, Q4_0, Q4_1 and Q4_K linear weights (experts
included) are not dequantized: `gguf_quant` keeps them in their blocks (`woq/linears.safetensors`), and the
loader builds int8 / int4 layers from them.

`convert_gguf` writes into a fresh folder and is not atomic by itself; `hub.py` builds in a
temporary folder and renames it into place.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specdec.models.gguf_quant import read_quantized_linears, save_quantized_linears

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3moe")

# llama.cpp (llama-vocab.cpp) stops on these besides the eos/eot/eom ids the file names.
_END_OF_GENERATION_TOKENS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
    "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
)


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, *, dtype: torch.dtype = torch.bfloat16,
                 progress: bool = True, keep_quantized: bool = True) -> Path:
    """Write `out_dir/{model.safetensors,config.json,tokenizer*.json,generation_config.json}` (and
    `woq/linears.safetensors` when the file has linears of a kept type and `keep_quantized`).

    `out_dir` must not exist yet or be empty. Raises ValueError for an architecture outside
    SUPPORTED_ARCHITECTURES or a file whose tensors do not cover the model.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if any(out_dir.iterdir()):
        raise FileExistsError(f"conversion target {out_dir} is not empty")
    metadata = read_gguf_metadata(gguf_path)
    config = read_config(gguf_path, metadata)
    config.dtype = dtype
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))  # parsing its metadata is slow (Python per token): once
    quantized, replaced = (read_quantized_linears(gguf_path, config, metadata["architecture"], reader)
                           if keep_quantized else ({}, set()))
    tensors = read_weights(gguf_path, config, metadata, dtype=dtype, progress=progress, kept_quantized=replaced,
                           reader=reader)
    save_weights(tensors, out_dir / "model.safetensors")
    if quantized:
        save_quantized_linears(quantized, out_dir)
    config.save_pretrained(out_dir)
    read_tokenizer(gguf_path, metadata).save_pretrained(out_dir)
    build_generation_config(metadata, config).save_pretrained(out_dir)
    return out_dir


def read_gguf_metadata(gguf_path: Path) -> dict:
    """The few metadata fields this file needs, plus the tensor names (no tensor data read)."""
    from transformers.integrations.gguf import read_gguf_metadata as read_fast

    metadata, tensor_names = read_fast(str(gguf_path), ("tokenizer.ggml.tokens",))
    architecture = metadata["general.architecture"]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{gguf_path}: GGUF architecture {architecture!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if architecture != "qwen3moe" and metadata.get(f"{architecture}.expert_count"):
        raise ValueError(f"{gguf_path}: a mixture-of-experts {architecture!r} GGUF (Mixtral-style, "
                         f"{architecture}.expert_count = {metadata[f'{architecture}.expert_count']}) is not "
                         f"supported; load its safetensors checkpoint instead")
    return {
        "architecture": architecture,
        "tensor_names": list(tensor_names),
        "tokens": metadata.get("tokenizer.ggml.tokens", []),
        "pre_tokenizer": metadata.get("tokenizer.ggml.pre"),
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
        "eos_token_ids": [metadata.get(f"tokenizer.ggml.{kind}_token_id") for kind in ("eos", "eot", "eom")],
        "expert_feed_forward_length": metadata.get(f"{architecture}.expert_feed_forward_length"),
    }


def read_config(gguf_path: Path, metadata: dict | None = None):
    """transformers' config for the file, marked bf16 and with its model class named."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    config.__dict__.pop("_model_name_or_path", None)  # the GGUF's `general.name`, not a path
    if metadata and metadata.get("expert_feed_forward_length"):  # not in transformers' GGUF key map
        config.moe_intermediate_size = int(metadata["expert_feed_forward_length"])
    model_class = AutoModelForCausalLM._model_mapping[type(config)]
    config.architectures = [model_class.__name__]
    return config


def read_weights(gguf_path: Path, config, metadata: dict, *, dtype: torch.dtype,
                 progress: bool, kept_quantized: set[str] = frozenset(), reader=None) -> dict[str, torch.Tensor]:
    """Dequantized tensors under transformers names, each checked against the model's shape;
    the names in ``kept_quantized`` (stored by ``gguf_quant``) are left out and never dequantized.

    transformers' tensor processors do the renaming and un-permuting, one tensor at a time
    over ``GGUFReader``'s memory map (its ``load_gguf_checkpoint`` would dequantize every tensor,
    kept ones included, and hold stacked experts in float32)."""
    from gguf import GGUFReader, dequantize
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    if "rope_freqs.weight" in metadata["tensor_names"]:
        # Llama-3.1-style rope scaling lives in this tensor; transformers' GGUF config ignores it.
        raise ValueError(f"{gguf_path}: GGUF with rope_freqs (Llama 3.1 rope scaling) is not supported")
    with torch.device("meta"):  # names and shapes only: no memory, no init
        model = AutoModelForCausalLM.from_config(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    for name in kept_quantized:
        expected.pop(name, None)
    processor = gguf_utils.TENSOR_PROCESSORS.get(metadata["architecture"], gguf_utils.TensorProcessor)(
        config=config.to_dict())
    name_map = gguf_utils.get_gguf_hf_weights_map(model, processor)
    parsed = {"tensors": {}}  # where transformers' MoE processor puts the experts it stacks
    for tensor in tqdm((reader or GGUFReader(str(gguf_path))).tensors, desc="dequantize GGUF tensors", disable=not progress):
        hf_name = name_map.get(tensor.name, name_map.get(tensor.name.removesuffix(".weight")))
        if hf_name not in expected:  # not a model weight, or kept quantized
            continue
        result = processor.process(weights=dequantize(tensor.data, tensor.tensor_type), name=tensor.name,
                                   tensor_key_mapping=name_map, parsed_parameters=parsed)
        if result.name in name_map:
            parsed["tensors"][name_map[result.name]] = torch.from_numpy(np.copy(result.weights)).to(dtype)
    tensors = {name: t.to(dtype).contiguous() for name, t in parsed["tensors"].items() if name in expected}
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(f"{gguf_path}: GGUF lacks {len(missing)} tensors the model needs, "
                         f"e.g. {missing[:5]}")
    wrong = [(n, tuple(t.shape), expected[n]) for n, t in tensors.items() if tuple(t.shape) != expected[n]]
    if wrong:
        raise ValueError(f"{gguf_path}: tensor shapes differ from the config, e.g. {wrong[:3]}")
    return split_stacked_experts(tensors)


def split_stacked_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' stacked expert parameters (``mlp.experts.gate_up_proj`` [E, 2I, H], gate rows
    first; ``mlp.experts.down_proj`` [E, H, I]) -> one checkpoint weight per expert and matrix
    (``mlp.experts.<e>.{gate,up,down}_proj.weight``), the names published checkpoints use."""
    out = {}
    for name, t in tensors.items():
        prefix, _, kind = name.rpartition(".experts.")
        if kind == "gate_up_proj" and t.ndim == 3:
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{prefix}.experts.{e}.gate_proj.weight"] = gate[e].clone()
                out[f"{prefix}.experts.{e}.up_proj.weight"] = up[e].clone()
        elif kind == "down_proj" and t.ndim == 3:
            out.update({f"{prefix}.experts.{e}.down_proj.weight": t[e].clone() for e in range(t.shape[0])})
        else:
            out[name] = t
    return out


def save_weights(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})


def read_tokenizer(gguf_path: Path, metadata: dict):
    """transformers' tokenizer rebuilt from GGUF metadata, with its pre-tokenization fixed up.

    llama.cpp names the upstream pre-tokenizer (`tokenizer.ggml.pre`); transformers rebuilds
    some of them only approximately: SmolLM splits every digit before the byte-level regex,
    Qwen2 NFC-normalizes first. Both are what the upstream tokenizer.json files say.
    """
    from tokenizers import normalizers, pre_tokenizers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    for loading_flag in ("is_local", "local_files_only"):  # how it was loaded, not what it is
        tokenizer.init_kwargs.pop(loading_flag, None)
    backend = tokenizer.backend_tokenizer
    if metadata["pre_tokenizer"] == "smollm":
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ])
    elif metadata["pre_tokenizer"] == "qwen2":
        backend.normalizer = normalizers.NFC()
    return tokenizer


def build_generation_config(metadata: dict, config):
    """EOS = the file's eos/eot/eom ids plus every end-of-generation token llama.cpp knows."""
    from transformers import GenerationConfig

    eos_ids = [i for i in metadata["eos_token_ids"] if i is not None]
    eos_ids += [i for i, token in enumerate(metadata["tokens"]) if token in _END_OF_GENERATION_TOKENS]
    eos_ids = list(dict.fromkeys(int(i) for i in eos_ids))  # dedupe, keep the file's eos first
    bos_id = metadata["bos_token_id"]
    pad_id = metadata["pad_token_id"]
    return GenerationConfig(
        bos_token_id=int(bos_id) if bos_id is not None else None,
        eos_token_id=eos_ids if len(eos_ids) != 1 else eos_ids[0],
        pad_token_id=int(pad_id) if pad_id is not None else (eos_ids[0] if eos_ids else None),
    )
