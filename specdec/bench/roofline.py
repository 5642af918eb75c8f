"""The decode roofline: memory bandwidth measured in this process, bytes a decode step reads.

A decode step is memory-bound: it streams every weight once (embedding tables excepted:
only the looked-up rows are read) plus the KV cache of every sequence in the batch. So

    roofline tokens/s = batch_size * bandwidth / (weight_bytes + batch_size * kv_bytes(context))

and ``measured / roofline`` says how much of the machine the engine uses. Bandwidth is a
large tensor copy, counted as bytes read + bytes written, best of several (the convention
in docs BENCHMARKING.md). A large batch eventually runs out of arithmetic instead: the
compute roof is the measured matmul FLOP/s over the FLOPs of one token (2 per weight plus
attention), and the *attainable* rate is the lower of the two roofs.
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
    streamed_matrix_elements: int = 0  # weights of the matmuls: 2 FLOPs each per token


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
    total = read = gathered = elements = 0
    for t, kinds in owners.values():
        n = tensor_nbytes(t)
        total += n
        if "stream" in kinds:
            read += n
            elements += t.numel() if t.dim() >= 2 else 0
        else:
            gathered += n
    return WeightBytes(total, read, gathered, elements)


def measure_matmul_flops(dtype: torch.dtype, device: torch.device | str = "cpu", rows: int = 512, size: int = 2048,
                         repeats: int = 10) -> float:
    """FLOP/s of a large matmul in the model's dtype, best of ``repeats`` (each ~20-40 ms on a
    2-core CPU, so the best one likely ran without a neighbour on the cores): the compute roof."""
    device = torch.device(device)
    a = torch.randn(rows, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * rows * size * size / best


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
    flops_per_s: float | None = None  # measured matmul rate (None: not measured)
    flops_per_token: float | None = None
    compute_tokens_per_s: float | None = None  # flops_per_s / flops_per_token

    @property
    def attainable_tokens_per_s(self) -> float:
        """The lower roof: memory for small batches, arithmetic for large ones."""
        if self.compute_tokens_per_s is None:
            return self.tokens_per_s
        return min(self.tokens_per_s, self.compute_tokens_per_s)

    def fraction(self, measured_tokens_per_s: float) -> float:
        return measured_tokens_per_s / self.tokens_per_s

    def as_dict(self) -> dict:
        d = asdict(self)
        d["bandwidth_gb_per_s"] = self.bandwidth_bytes_per_s / 1e9
        d["gb_per_step"] = self.bytes_per_step / 1e9
        d["attainable_tokens_per_s"] = self.attainable_tokens_per_s
        d["bound_by"] = "memory" if self.attainable_tokens_per_s == self.tokens_per_s else "compute"
        return d


def roofline(bandwidth: float, weights: WeightBytes, kv_per_token: int, mean_context_len: float,
             batch_size: int = 1, flops_per_s: float | None = None, attention_flops_per_context_token: int = 0
             ) -> Roofline:
    step = weights.read_per_step + batch_size * kv_per_token * mean_context_len
    flops_per_token = 2 * weights.streamed_matrix_elements + attention_flops_per_context_token * mean_context_len
    compute = flops_per_s / flops_per_token if flops_per_s and flops_per_token else None
    return Roofline(bandwidth, weights.total, weights.read_per_step, kv_per_token, mean_context_len, batch_size,
                    step, batch_size * bandwidth / step, flops_per_s, flops_per_token or None, compute)


def paired_fraction(tokens_per_s: list[float], bandwidths: list[float], roof: Roofline,
                    attainable: bool = False) -> float:
    """Median over repetitions of measured / roofline, each repetition against the bandwidth
    measured just before it (on a shared machine both move with the load). ``attainable``:
    against the lower of that memory roof and the compute roof."""
    import statistics

    fractions = []
    for tps, bw in zip(tokens_per_s, bandwidths):
        roof_now = roof.tokens_per_s * bw / roof.bandwidth_bytes_per_s
        if attainable and roof.compute_tokens_per_s is not None:
            roof_now = min(roof_now, roof.compute_tokens_per_s)
        fractions.append(tps / roof_now)
    return statistics.median(fractions)


def attention_flops_per_context_token(model_config) -> int:
    """Q.K and P.V: 2 x 2 FLOPs per query dimension, per layer, per token of context."""
    heads = model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    return 4 * model_config.num_hidden_layers * heads * head_dim


def engine_roofline(llm, bandwidth: float, mean_context_len: float, batch_size: int = 1,
                    flops_per_s: float | None = None) -> Roofline:
    """The roofline of an ``LLM``'s target model as loaded (dtype, packing, quantization)."""
    engine = llm.engine
    weights = llm.apply_model(weight_bytes)[0]  # the driver's (its shard under tensor parallelism)
    kv = kv_bytes_per_token(engine.model_config, engine.dtype)
    return roofline(bandwidth, weights, kv, mean_context_len, batch_size, flops_per_s,
                    attention_flops_per_context_token(engine.model_config))
