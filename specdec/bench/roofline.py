"""The decode roofline: memory bandwidth measured in this process, bytes a decode step reads.

A decode step is memory-bound: it streams every weight once (embedding tables excepted:
only the looked-up rows are read) plus the KV cache of every sequence in the batch. So

    roofline tokens/s = batch_size * bandwidth / (weight_bytes + batch_size * kv_bytes(context))

and ``measured / roofline`` says how much of the machine the engine uses. Bandwidth is a
large tensor copy, counted as bytes read + bytes written, best of several (the convention
in docs BENCHMARKING.md).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
from torch import nn

COPY_BYTES = 512 << 20  # per buffer: far beyond any last-level cache


def measure_bandwidth(num_bytes: int = COPY_BYTES, repeats: int = 7, device: torch.device | str = "cpu") -> float:
    """Bytes per second of a large tensor copy (read + write), best of ``repeats``."""
    device = torch.device(device)
    n = num_bytes // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch every page before timing
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n * 4 / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes a tensor occupies; works for opaque (oneDNN-packed) tensors too."""
    return t.numel() * t.element_size()


def _key(t: torch.Tensor):
    """Identity of a tensor's storage so shared (tied) weights count once."""
    try:
        return ("ptr", t.untyped_storage().data_ptr())
    except (NotImplementedError, RuntimeError):  # opaque tensors have no storage to ask
        return ("id", id(t))


@dataclass
class WeightBytes:
    total: int  # every parameter and buffer, shared storage counted once
    read_per_step: int  # what one decode step streams: everything except gathered tables
    gathered: int  # embedding / rotary tables: only the looked-up rows are read


def weight_bytes(model: nn.Module) -> WeightBytes:
    """Count the actual tensor bytes of a loaded model (packed / int8 buffers included).

    A tensor owned by an ``nn.Embedding`` (or a rotary cos/sin cache) is a gather, not a
    stream, unless the same storage is also used by another module: a tied embedding is
    read whole by the lm_head, and is then counted once.
    """
    owners: dict[object, tuple[torch.Tensor, set[str]]] = {}
    for module in model.modules():
        kind = "gather" if isinstance(module, nn.Embedding) or "Rotary" in type(module).__name__ else "stream"
        for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            if t is None:
                continue
            entry = owners.setdefault(_key(t), (t, set()))
            entry[1].add(kind)
    total = read = gathered = 0
    for t, kinds in owners.values():
        n = tensor_nbytes(t)
        total += n
        if "stream" in kinds:
            read += n
        else:
            gathered += n
    return WeightBytes(total, read, gathered)


def kv_bytes_per_token(model_config, dtype: torch.dtype) -> int:
    """Keys + values of one token over all layers."""
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return model_config.num_hidden_layers * 2 * kv_heads * head_dim * itemsize


@dataclass
class Roofline:
    bandwidth_bytes_per_s: float
    weight_bytes_total: int
    weight_bytes_per_step: int
    kv_bytes_per_token: int
    mean_context_len: float
    batch_size: int
    bytes_per_step: float
    tokens_per_s: float  # batch_size * bandwidth / bytes_per_step: plain decoding's limit

    def fraction(self, measured_tokens_per_s: float) -> float:
        return measured_tokens_per_s / self.tokens_per_s

    def as_dict(self) -> dict:
        d = asdict(self)
        d["bandwidth_gb_per_s"] = self.bandwidth_bytes_per_s / 1e9
        d["gb_per_step"] = self.bytes_per_step / 1e9
        return d


def roofline(bandwidth: float, weights: WeightBytes, kv_per_token: int, mean_context_len: float,
             batch_size: int = 1) -> Roofline:
    step = weights.read_per_step + batch_size * kv_per_token * mean_context_len
    return Roofline(bandwidth, weights.total, weights.read_per_step, kv_per_token, mean_context_len, batch_size,
                    step, batch_size * bandwidth / step)


def paired_fraction(tokens_per_s: list[float], bandwidths: list[float], roof: Roofline) -> float:
    """Median over repetitions of measured / roofline, each repetition against the bandwidth
    measured just before it (on a shared machine both move with the load)."""
    import statistics

    fractions = [tps / (roof.tokens_per_s * bw / roof.bandwidth_bytes_per_s)
                 for tps, bw in zip(tokens_per_s, bandwidths)]
    return statistics.median(fractions)


def engine_roofline(llm, bandwidth: float, mean_context_len: float, batch_size: int = 1) -> Roofline:
    """The roofline of an ``LLM``'s target model as loaded (dtype, packing, quantization)."""
    engine = llm.engine
    weights = weight_bytes(engine.runner.model)
    kv = kv_bytes_per_token(engine.model_config, engine.runner.dtype)
    return roofline(bandwidth, weights, kv, mean_context_len, batch_size)
