"""GGUF Q8_0 / Q4_0 linear weights kept quantized: read from the file, stored beside the converted
folder, loaded into ``WeightOnlyLinear`` (``specdec.layers.quantization``) without a float copy.

Both types map onto specdec's formats (``specdec.kernels.woq_format``) exactly, block for block:
- Q8_0, 34 bytes per 32 inputs: fp16 d, then 32 int8 q; w = q * d -> ``Int8Weight`` with G = 32.
- Q4_0, 18 bytes per 32 inputs: fp16 d, then 16 bytes of nibbles (byte j: input j low, j + 16
  high); w = (q - 8) * d -> ``Int4Weight`` with G = 32, zero points 8, the same nibble order.
Other types (Q4_K, Q6_K, ...) are dequantized by ``gguf_convert`` as before. specdec fuses q/k/v
and gate/up into one linear, so a fused group stays quantized only if all its parts share one
kept type; llama.cpp's row permutation of Llama Q/K is undone on the quantized rows.
``woq/linears.safetensors`` holds ``<module>.qweight`` + ``.scales`` (int8) or ``.packed`` +
``.scales`` + ``.offsets`` (int4), under specdec module names (``layers.0.self_attn.qkv_proj``).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from specdec.kernels.woq_format import BLOCK, Int4Weight, Int8Weight

WOQ_FILE = Path("woq") / "linears.safetensors"
_Q8_0, _Q4_0 = 8, 2  # gguf.GGMLQuantizationType values
_PARTS = {  # GGUF tensor (per layer) -> (specdec module, part index in the fused module)
    "attn_q": ("self_attn.qkv_proj", 0), "attn_k": ("self_attn.qkv_proj", 1), "attn_v": ("self_attn.qkv_proj", 2),
    "attn_output": ("self_attn.o_proj", 0), "ffn_gate": ("mlp.gate_up_proj", 0), "ffn_up": ("mlp.gate_up_proj", 1),
    "ffn_down": ("mlp.down_proj", 0),
}
_NUM_PARTS = {"self_attn.qkv_proj": 3, "mlp.gate_up_proj": 2}
_HF_PARTS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
             "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def _blocks_to_weight(data: np.ndarray, qtype: int) -> Int8Weight | Int4Weight:
    """Raw GGUF rows [N, bytes per row] -> the matching specdec format."""
    n = data.shape[0]
    size = 34 if qtype == _Q8_0 else 18
    blocks = np.ascontiguousarray(data).reshape(n, -1, size)
    scales = torch.from_numpy(blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))
    payload = torch.from_numpy(blocks[..., 2:].copy().reshape(n, -1))
    if qtype == _Q8_0:
        return Int8Weight(payload.view(torch.int8).contiguous(), scales.contiguous())
    return Int4Weight(payload.contiguous(), scales.contiguous(), -8.0 * scales)


def _unpermute_rows(weight: Int8Weight | Int4Weight, num_heads: int) -> Int8Weight | Int4Weight:
    """transformers' LlamaTensorProcessor._reverse_permute_weights, applied to every row tensor."""
    def rows(t: torch.Tensor) -> torch.Tensor:
        dim = t.shape[0] // num_heads // 2
        return t.reshape(num_heads, dim, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape).contiguous()
    if isinstance(weight, Int8Weight):
        return Int8Weight(rows(weight.qweight), rows(weight.scales))
    return Int4Weight(rows(weight.packed), rows(weight.scales), rows(weight.offsets))


def _concat(parts: list) -> Int8Weight | Int4Weight:
    if isinstance(parts[0], Int8Weight):
        return Int8Weight(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]))
    return Int4Weight(*(torch.cat([getattr(p, f) for p in parts]) for f in ("packed", "scales", "offsets")))


def read_quantized_linears(gguf_path: Path, config, architecture: str) -> tuple[dict, set[str]]:
    """({specdec module name: weight}, the transformers weight names they replace)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    found: dict[str, dict[int, tuple[int, object]]] = {}
    for tensor in reader.tensors:
        qtype = int(tensor.tensor_type)
        if qtype not in (_Q8_0, _Q4_0) or tensor.data.ndim != 2 or int(tensor.shape[0]) % BLOCK:
            continue
        pieces = tensor.name.split(".")
        if tensor.name == "output.weight" and not config.tie_word_embeddings:
            module, part = "lm_head", 0
        elif len(pieces) == 4 and pieces[0] == "blk" and pieces[2] in _PARTS and pieces[3] == "weight":
            name, part = _PARTS[pieces[2]]
            module = f"layers.{pieces[1]}.{name}"
            if architecture == "llama" and pieces[2] in ("attn_q", "attn_k"):
                heads = config.num_attention_heads if pieces[2] == "attn_q" else config.num_key_value_heads
                found.setdefault(module, {})[part] = (qtype, _unpermute_rows(_blocks_to_weight(tensor.data, qtype), heads))
                continue
        else:
            continue
        found.setdefault(module, {})[part] = (qtype, _blocks_to_weight(tensor.data, qtype))
    kept, replaced = {}, set()
    for module, parts in found.items():
        kind = module.split(".", 2)[-1] if module != "lm_head" else module
        num_parts = _NUM_PARTS.get(kind, 1)
        if len(parts) != num_parts or len({qtype for qtype, _ in parts.values()}) != 1:
            continue  # a fused group with a part of another type: dequantized like that part
        kept[module] = _concat([parts[i][1] for i in range(num_parts)])
        prefix = "" if module == "lm_head" else "model."
        layer = module.rsplit(".", 2)[0] if module != "lm_head" else ""
        names = [f"{layer}.{p}" for p in _HF_PARTS[kind]] if kind in _HF_PARTS else [module]
        replaced.update(f"{prefix}{name}.weight" for name in names)
    return kept, replaced


def save_quantized_linears(linears: dict, folder: Path) -> None:
    from safetensors.torch import save_file

    tensors = {}
    for module, w in linears.items():
        fields = ("qweight", "scales") if isinstance(w, Int8Weight) else ("packed", "scales", "offsets")
        tensors.update({f"{module}.{f}": getattr(w, f).contiguous() for f in fields})
    (folder / WOQ_FILE).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / WOQ_FILE), metadata={"format": "specdec-woq-1"})


def load_quantized_linears(folder: str | Path) -> dict[str, Int8Weight | Int4Weight]:
    """The kept-quantized linears of a converted folder ({} when it has none)."""
    from safetensors.torch import load_file

    path = Path(folder) / WOQ_FILE
    if not path.is_file():
        return {}
    tensors = load_file(str(path))
    modules = {name.rsplit(".", 1)[0] for name in tensors}
    return {m: (Int4Weight(tensors[f"{m}.packed"], tensors[f"{m}.scales"], tensors[f"{m}.offsets"])
                if f"{m}.packed" in tensors else Int8Weight(tensors[f"{m}.qweight"], tensors[f"{m}.scales"]))
            for m in modules}


def install_quantized_linears(model: nn.Module, linears: dict, dtype: torch.dtype, device: torch.device) -> None:
    """Swap each named ``nn.Linear`` for a ``WeightOnlyLinear`` over its stored weight; a bias
    stays a parameter of the new module, for the checkpoint loader to fill."""
    from specdec.layers.quantization import WeightOnlyLinear, weight_shape

    for name, weight in linears.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child)
        if not isinstance(old, nn.Linear) or (old.out_features, old.in_features) != weight_shape(weight):
            raise ValueError(f"quantized GGUF weight {name!r} {weight_shape(weight)} does not fit the model's {old}")
        bias = None if old.bias is None else torch.empty(old.out_features, dtype=dtype, device=device)
        new = WeightOnlyLinear(weight, bias, dtype).to(device)
        setattr(parent, child, new)
