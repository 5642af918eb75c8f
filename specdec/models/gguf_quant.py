"""GGUF quantized linear weights kept quantized: read from the file, stored beside the converted
folder, loaded into ``WeightOnlyLinear`` (``specdec.layers.quantization``) without a float copy.

Each kept type maps onto one of specdec's formats (``specdec.kernels.cpu.woq_format``) exactly: the
weight the kernel computes with is, value for value, the ``gguf`` package's dequantization.

| GGUF type | block | specdec format |
|---|---|---|
| Q8_0 | 32: fp16 d, int8 q; w = d q | ``Int8Weight``, G = 32 |
| Q5_0 | 32: fp16 d, 5-bit q; w = d (q - 16) | ``Int8Weight``, G = 32 (q - 16 in int8) |
| Q6_K | 256: 16 int8 scales, fp16 d, 6-bit q; w = d sc (q - 32) per 16 | ``Int8Weight``, G = 16 |
| Q4_0 | 32: fp16 d, 4-bit q; w = d (q - 8) | ``Int4Weight``, G = 32, offsets -8 d |
| Q4_1 | 32: fp16 d, fp16 m, 4-bit q; w = d q + m | ``Int4Weight``, G = 32, offsets m |
| Q4_K | 256: fp16 d, dmin, 6-bit sc / m per 32, 4-bit q; w = d sc q - dmin m | ``Int4Weight``, G = 32 |

The integer codes come from ``gguf``'s own dequantizer run over a copy of the blocks whose
scales are set to one (and mins to zero), so no bit layout is decoded here; the scales and
offsets are computed as ``gguf`` computes them. Other types (Q5_K, Q3_K, ...) are dequantized by
``gguf_convert`` as before. specdec fuses q/k/v and gate/up into one linear: parts of one format
are concatenated (int8 scales repeated down to the smallest group), and a group whose parts
have different formats (Q4_K_M's Q4_K q/k with a Q6_K v) is kept as a list of parts. llama.cpp's
row permutation of Llama Q/K is undone on the quantized rows.
``woq/linears.safetensors`` holds ``<module>.qweight`` + ``.scales`` (int8) or ``.packed`` +
``.scales`` + ``.offsets`` (int4), under specdec module names (``layers.0.self_attn.qkv_proj``),
with ``<module>.part<i>.<field>`` for the parts of a mixed group.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from specdec.kernels.cpu.woq_format import Int4Weight, Int8Weight, pack_nibbles

WOQ_FILE = Path("woq") / "linears.safetensors"
WOQ_FORMAT = "specdec-woq-2"
_PARTS = {  # GGUF tensor (per layer) -> (specdec module, part index in the fused module)
    "attn_q": ("self_attn.qkv_proj", 0), "attn_k": ("self_attn.qkv_proj", 1), "attn_v": ("self_attn.qkv_proj", 2),
    "attn_output": ("self_attn.o_proj", 0), "ffn_gate": ("mlp.gate_up_proj", 0), "ffn_up": ("mlp.gate_up_proj", 1),
    "ffn_down": ("mlp.down_proj", 0),
}
_NUM_PARTS = {"self_attn.qkv_proj": 3, "mlp.gate_up_proj": 2}
_HF_PARTS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
             "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
_FP16_ONE = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)


def _quants():
    from gguf import GGMLQuantizationType as T, quants
    return T, quants


def kept_types() -> dict[int, tuple[int, int]]:
    """{GGML type value: (inputs per block, bytes per block)} of the types kept quantized."""
    T, _ = _quants()
    from gguf import GGML_QUANT_SIZES
    return {int(t): GGML_QUANT_SIZES[t] for t in (T.Q8_0, T.Q5_0, T.Q6_K, T.Q4_0, T.Q4_1, T.Q4_K)}


def _fp16(blocks: np.ndarray, at: int) -> np.ndarray:
    """[n, blocks] float32 of the fp16 field at byte ``at`` of each block."""
    return np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32)


def _codes(qtype: int, blocks: np.ndarray, unit: dict[int, np.ndarray]) -> np.ndarray:
    """The integer codes of [n, nb, bytes] blocks: ``gguf``'s dequantization with the header bytes
    in ``unit`` (byte offset -> bytes) overwritten by unit scales. -> [n, nb * block] float32."""
    _, quants = _quants()
    from gguf import GGMLQuantizationType
    ones = blocks.copy()
    for at, value in unit.items():
        ones[..., at:at + len(value)] = value
    n = blocks.shape[0]
    return quants.dequantize(ones.reshape(n, -1), GGMLQuantizationType(qtype)).reshape(n, -1)


def _blocks_to_weight(data: np.ndarray, qtype: int) -> Int8Weight | Int4Weight:
    """Raw GGUF rows [N, bytes per row] -> the matching specdec format."""
    T, quants = _quants()
    per_block, size = kept_types()[qtype]
    n = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(n, -1, size)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))  # noqa: E731
    if qtype == T.Q8_0:
        payload = torch.from_numpy(blocks[..., 2:].copy().reshape(n, -1))
        return Int8Weight(payload.view(torch.int8).contiguous(), t(_fp16(blocks, 0)))
    if qtype == T.Q4_0:
        d = t(_fp16(blocks, 0))
        return Int4Weight(torch.from_numpy(blocks[..., 2:].copy().reshape(n, -1)), d, -8.0 * d)
    if qtype == T.Q4_1:  # nibbles already in Q4_0 order
        return Int4Weight(torch.from_numpy(blocks[..., 4:].copy().reshape(n, -1)), t(_fp16(blocks, 0)),
                          t(_fp16(blocks, 2)))
    if qtype == T.Q5_0:
        q = _codes(qtype, blocks, {0: _FP16_ONE})  # q - 16
        return Int8Weight(torch.from_numpy(q.astype(np.int8)), t(_fp16(blocks, 0)))
    if qtype == T.Q6_K:  # ql[128] qh[64] scales[16] (int8) d (fp16)
        q = _codes(qtype, blocks, {192: np.ones(16, np.uint8), 208: _FP16_ONE})  # q - 32
        scales = _fp16(blocks, 208)[..., None] * blocks[..., 192:208].view(np.int8).astype(np.float32)
        return Int8Weight(torch.from_numpy(q.astype(np.int8)), t(scales.reshape(n, -1)))
    # Q4_K: d, dmin (fp16), 12 bytes of 6-bit scales / mins, qs[128]
    unit_scales = np.array([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1], np.uint8)  # every sc 1, every m 0
    q = _codes(qtype, blocks, {0: _FP16_ONE, 2: np.zeros(2, np.uint8), 4: unit_scales})
    sc, m = quants.Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))
    d = _fp16(blocks, 0).reshape(-1, 1) * sc.astype(np.float32)
    dm = _fp16(blocks, 2).reshape(-1, 1) * m.astype(np.float32)
    return Int4Weight(pack_nibbles(torch.from_numpy(q.astype(np.uint8))), t(d.reshape(n, -1)), t(-dm.reshape(n, -1)))


def _fields(weight: Int8Weight | Int4Weight) -> tuple[str, ...]:
    return ("qweight", "scales") if isinstance(weight, Int8Weight) else ("packed", "scales", "offsets")


def _map_rows(weight: Int8Weight | Int4Weight, fn) -> Int8Weight | Int4Weight:
    return type(weight)(*(fn(getattr(weight, f)) for f in _fields(weight)))


def _unpermute_rows(weight: Int8Weight | Int4Weight, num_heads: int) -> Int8Weight | Int4Weight:
    """transformers' LlamaTensorProcessor._reverse_permute_weights, applied to every row tensor."""
    def rows(t: torch.Tensor) -> torch.Tensor:
        dim = t.shape[0] // num_heads // 2
        return t.reshape(num_heads, dim, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape).contiguous()
    return _map_rows(weight, rows)


def _concat(parts: list) -> Int8Weight | Int4Weight | tuple:
    """One weight over the parts' rows when they share a format, else the tuple of parts."""
    if len(parts) == 1:
        return parts[0]
    if len({type(p) for p in parts}) > 1:
        return tuple(parts)
    if isinstance(parts[0], Int8Weight):
        group = min(p.group_size for p in parts)
        scales = [p.scales.repeat_interleave(p.group_size // group, dim=1) for p in parts]
        return Int8Weight(torch.cat([p.qweight for p in parts]), torch.cat(scales))
    if len({p.group_size for p in parts}) > 1:
        return tuple(parts)
    return Int4Weight(*(torch.cat([getattr(p, f) for p in parts]) for f in _fields(parts[0])))


def read_quantized_linears(gguf_path: Path, config, architecture: str) -> tuple[dict, set[str]]:
    """({specdec module name: weight}, the transformers weight names they replace)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    types = kept_types()
    found: dict[str, dict[int, tuple[int, object]]] = {}
    for tensor in reader.tensors:
        qtype = int(tensor.tensor_type)
        if qtype not in types or tensor.data.ndim != 2 or int(tensor.shape[0]) % types[qtype][0]:
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
        if len(parts) != num_parts:
            continue  # a fused group with a part of a type not kept: dequantized like that part
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
        for prefix, part in ([(f"{module}.part{i}", p) for i, p in enumerate(w)] if isinstance(w, tuple)
                             else [(module, w)]):
            tensors.update({f"{prefix}.{f}": getattr(part, f).contiguous() for f in _fields(part)})
    (folder / WOQ_FILE).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / WOQ_FILE), metadata={"format": WOQ_FORMAT})


def has_quantized_linears(folder: str | Path) -> bool:
    """Whether a converted folder keeps GGUF linears in their quantized blocks."""
    return (Path(folder) / WOQ_FILE).is_file()


def load_quantized_linears(folder: str | Path) -> dict[str, Int8Weight | Int4Weight | tuple]:
    """The kept-quantized linears of a converted folder ({} when it has none)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    if not has_quantized_linears(folder):
        return {}
    path = Path(folder) / WOQ_FILE
    with safe_open(str(path), framework="pt") as f:
        fmt = (f.metadata() or {}).get("format")
    if fmt != WOQ_FORMAT:
        raise ValueError(f"{path} is in format {fmt!r}, this specdec reads {WOQ_FORMAT!r}: delete the converted "
                         f"folder {folder} and load the .gguf again")
    tensors = load_file(str(path))

    def weight(prefix: str) -> Int8Weight | Int4Weight:
        if f"{prefix}.packed" in tensors:
            return Int4Weight(tensors[f"{prefix}.packed"], tensors[f"{prefix}.scales"], tensors[f"{prefix}.offsets"])
        return Int8Weight(tensors[f"{prefix}.qweight"], tensors[f"{prefix}.scales"])

    out: dict[str, Int8Weight | Int4Weight | tuple] = {}
    for prefix in sorted({name.rsplit(".", 1)[0] for name in tensors}):
        module, _, last = prefix.rpartition(".")
        if last.startswith("part") and last[4:].isdigit():
            out.setdefault(module, {})[int(last[4:])] = weight(prefix)
        else:
            out[prefix] = weight(prefix)
    return {m: tuple(w[i] for i in sorted(w)) if isinstance(w, dict) else w for m, w in out.items()}


def install_quantized_linears(model: nn.Module, linears: dict, dtype: torch.dtype, device: torch.device) -> None:
    """Swap each named ``nn.Linear`` for a ``WeightOnlyLinear`` over its stored weight (a tuple of
    parts: over its parts, outputs concatenated); a bias stays a parameter of the new module, for
    the checkpoint loader to fill."""
    from specdec.layers.quantization import PartsLinear, WeightOnlyLinear, weight_shape

    for name, weight in linears.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child)
        if not isinstance(old, nn.Linear) or (old.out_features, old.in_features) != weight_shape(weight):
            raise ValueError(f"quantized GGUF weight {name!r} {weight_shape(weight)} does not fit the model's {old}")
        bias = None if old.bias is None else torch.empty(old.out_features, dtype=dtype, device=device)
        new = (PartsLinear(weight, bias, dtype) if isinstance(weight, tuple) else WeightOnlyLinear(weight, bias, dtype))
        new = new.to(device)
        setattr(parent, child, new)
