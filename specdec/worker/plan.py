"""RuntimePlan: every runtime choice of a worker, resolved once from the EngineConfig and the machine.

The device, the compute dtype, the weight format of each layer kind (target and draft), the
attention backend, the rejection sampler, whether steps run in CUDA/HIP graphs and the KV cache
budget. ``resolve_plan`` reads config files at most and loads no weights, so a plan can be built
and checked for any config on any machine (``Machine`` answers from given facts before probing
the real one); its ``str`` is the few lines the worker logs once at start-up. ``worker/setup.py``
assembles the parts the plan names and fills in the KV block count once the weights are loaded.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from specdec.config import EngineConfig
from specdec.engine.kv_layout import KVLayout
from specdec.spec_decode.methods import method_of
from specdec.worker import device as device_info
from specdec.worker.kv_budget import DEFAULT_CPU_KV_BYTES, blocks_per_sequence, num_kv_blocks  # noqa: F401
from specdec.worker.model_runner import ModelRunner

# int8 activations round a layer's input: they need every other op to compute a token's row the
# same in a decode step and in a verification (specdec.kernels.cpu.attention_rows)
ROW_CONSISTENT_QUANTIZATIONS = ("w8a8", "w4a8")


def _probe_rows_kernel(device: torch.device) -> bool:
    """Whether the row-by-row C++ attention kernel runs here, asked without its warnings."""
    from specdec.kernels.cpu import cpp_build, woq_cpu
    from specdec.kernels.cpu.attention_rows import extension

    if cpp_build.disabled(woq_cpu.DISABLE_ENV) or not woq_cpu.cpu_isas():
        return False
    return extension() is not None


def _probe_triton(device: torch.device) -> bool:
    try:
        from specdec.layers.attention_triton import TRITON_BACKEND  # noqa: F401
    except ImportError:
        return False
    return True


def _probe_triton_sampler(device: torch.device) -> bool:
    try:
        from specdec.spec_decode.rejection_sampler_triton import rejection_sample_triton  # noqa: F401
    except ImportError:
        return False
    return True


def _probe_bf16_kernel_faster(device: torch.device) -> bool:
    from specdec.layers.quantization import bf16_kernel_faster

    return bf16_kernel_faster()


_PROBES = {
    "cpu_bf16": lambda device: device_info.cpu_supports_bf16(),  # native bf16 matmul (AMX / AVX512-BF16)
    "cuda_bf16": lambda device: torch.cuda.is_bf16_supported(),
    "bf16_kernel_faster": _probe_bf16_kernel_faster,  # bf16-weight linears beat oneDNN's here (measured)
    "rows_kernel": _probe_rows_kernel,
    "triton": _probe_triton,  # the Triton attention kernels import
    "triton_sampler": _probe_triton_sampler,
}


class Machine:
    """The facts about the machine a plan depends on. A fact given to the constructor is taken as
    is; any other is probed on first use (some probes build kernels or time them)."""

    def __init__(self, device: torch.device, **facts: bool):
        unknown = set(facts) - set(_PROBES)
        if unknown:
            raise ValueError(f"unknown machine facts {sorted(unknown)}; known: {sorted(_PROBES)}")
        self.device = device
        self._facts = dict(facts)

    def has(self, fact: str) -> bool:
        if fact not in self._facts:
            self._facts[fact] = bool(_PROBES[fact](self.device))
        return self._facts[fact]

    def default_dtype(self) -> torch.dtype:
        """``dtype="auto"``: bf16 where the device computes in it (fp16 on GPUs without bf16), else float32."""
        if self.device.type == "cuda":
            return torch.bfloat16 if self.has("cuda_bf16") else torch.float16
        return torch.bfloat16 if self.has("cpu_bf16") else torch.float32

    def resolve_dtype(self, dtype: str) -> torch.dtype:
        return self.default_dtype() if dtype == "auto" else device_info.resolve_dtype(dtype, self.device)


BF16_WIDENING_DTYPES = ("auto", "bfloat16")


def bf16_weights_mode(requested: str, dtype: torch.dtype, device: torch.device) -> str | None:
    """``dtype="auto"`` or ``"bfloat16"`` that became float32 activations on a CPU: linears a bf16
    checkpoint filled keep their bf16 weights ("exact": the same values, half the bytes per step)."""
    return ("exact" if requested in BF16_WIDENING_DTYPES and dtype == torch.float32 and device.type == "cpu"
            else None)


@dataclass(frozen=True)
class WeightPlan:
    """How one model's weights are loaded and kept."""
    load_dtype: torch.dtype  # the checkpoint's tensors are loaded in this dtype
    compute_dtype: torch.dtype  # activations, KV cache and every weight but the linears'
    quantization: str | None  # linears: one of QUANTIZATION_METHODS (``prepare_for_inference``)
    bf16_weights: str | None  # "exact": linears a bf16 checkpoint filled keep their bf16 weights

    @property
    def is_widened(self) -> bool:
        """bf16 weights with float32 activations (``Bf16WeightLinear``)."""
        return self.load_dtype == torch.bfloat16 and self.compute_dtype == torch.float32

    def describe(self) -> str:
        if self.quantization is not None:
            linears = self.quantization
        elif self.is_widened:
            linears = "bfloat16"
        elif self.bf16_weights:
            linears = f"bfloat16 where the checkpoint is, else {_name(self.load_dtype)}"
        else:
            linears = _name(self.load_dtype)
        return f"linears {linears}, other layers {_name(self.compute_dtype)}"


@dataclass(frozen=True)
class RuntimePlan:
    device: torch.device
    dtype: torch.dtype  # the target's activations and KV cache
    target: WeightPlan
    method: str | None  # the speculative method (None: no speculation)
    draft: WeightPlan | None  # the method's draft model or head (None: draft-free)
    attention_backend: str  # "reference" | "torch" | "rows" | "triton"
    sampler: str  # rejection sampler: "triton" | "torch"
    graphs: bool  # decode and verification steps run in CUDA/HIP graphs
    graph_batch_sizes: tuple[int, ...]  # batch sizes captured (when graphs)
    tensor_parallel_size: int
    block_size: int
    max_spec_slots: int  # KV slots each request reserves for drafts
    kv_budget_bytes: int | None  # kv_cache_memory, or the CPU default; None: what gpu_memory_utilization leaves
    num_kv_blocks: int | None = None  # known once the weights are loaded (``with_kv_blocks``)
    kv_bytes_per_block: int | None = None  # target and draft caches together
    kv_layout: KVLayout | None = None  # the block pools per KV cache group (the first: num_kv_blocks)

    def with_kv_blocks(self, num_blocks: int, bytes_per_block: int) -> RuntimePlan:
        return dataclasses.replace(self, num_kv_blocks=num_blocks, kv_bytes_per_block=bytes_per_block)

    def with_kv_layout(self, layout: KVLayout, bytes_per_block: int) -> RuntimePlan:
        """``bytes_per_block``: a block of every group together (target and draft caches)."""
        return dataclasses.replace(self, num_kv_blocks=layout.groups[0].num_blocks, kv_bytes_per_block=bytes_per_block,
                                   kv_layout=layout)

    def __str__(self) -> str:
        lines = [f"device {self.device}, compute dtype {_name(self.dtype)}, "
                 f"tensor parallel {self.tensor_parallel_size}",
                 f"target: {self.target.describe()}"]
        if self.method is not None:
            draft = f": {self.draft.describe()}" if self.draft is not None else " (no draft model)"
            lines.append(f"speculation: {self.method}{draft}, {self.max_spec_slots} draft slots per request")
        graphs = f"graphs at batch sizes {list(self.graph_batch_sizes)}" if self.graphs else "eager"
        lines.append(f"attention {self.attention_backend}, rejection sampler {self.sampler}, {graphs}")
        if self.kv_layout is not None and self.kv_layout.num_groups > 1:
            lines.append(f"KV cache: blocks of {self.block_size} tokens, {self.kv_layout.describe()} "
                         f"({self.kv_layout.num_bytes / 2**20:.0f} MiB)")
        elif self.num_kv_blocks is not None:
            mib = self.num_kv_blocks * self.kv_bytes_per_block / 2**20
            lines.append(f"KV cache: {self.num_kv_blocks} blocks of {self.block_size} tokens ({mib:.0f} MiB)")
        else:
            budget = "gpu_memory_utilization" if self.kv_budget_bytes is None else f"{self.kv_budget_bytes} bytes"
            lines.append(f"KV cache: blocks of {self.block_size} tokens, budget {budget}")
        return "runtime plan: " + "\n  ".join(lines)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_plan(cfg: EngineConfig, model_path: str, model_config, max_model_len: int, machine: Machine,
                 tensor_parallel: bool = False) -> RuntimePlan:
    """The plan for ``cfg``'s target (``model_config``, read from ``model_path``) on ``machine``;
    ``tensor_parallel``: this worker is one rank of several."""
    device = machine.device
    spec = cfg.speculative_config
    method = method_of(spec)
    max_k = spec.num_spec_slots if spec else 0
    f32_bytes = ModelRunner.kv_bytes_per_block(model_config, cfg.block_size, torch.float32)
    if _bf16_weights_float32_activations(cfg, machine, model_path, tensor_parallel) and _kv_fits(
            cfg, f32_bytes, max_model_len, max_k):
        target = WeightPlan(torch.bfloat16, torch.float32, None, bf16_weights_mode(cfg.dtype, torch.float32, device))
    else:
        dtype = _compute_dtype(cfg, machine)
        target = WeightPlan(dtype, dtype, cfg.quantization, bf16_weights_mode(cfg.dtype, dtype, device))
    dtype = target.compute_dtype
    attention = attention_backend_name(cfg, machine, dtype)
    graphs = (device.type == "cuda" and attention == "triton" and not cfg.enforce_eager and not tensor_parallel
              and (method is None or method.graph_capturable))  # collectives are not captured in graphs yet
    # LoRA rows take their adapter from each step's metadata, which a replayed graph does not read
    graphs = graphs and not cfg.enable_lora
    sampler = "triton" if device.type == "cuda" and machine.has("triton_sampler") else "torch"
    if cfg.kv_cache_memory is not None:
        budget = cfg.kv_cache_memory
    else:
        budget = None if device.type == "cuda" else DEFAULT_CPU_KV_BYTES
    return RuntimePlan(
        device=device, dtype=dtype, target=target, method=spec.method if spec else None,
        draft=method.plan_draft(spec, cfg, target, device) if method else None,
        attention_backend=attention, sampler=sampler, graphs=graphs,
        graph_batch_sizes=tuple(sorted({b for b in cfg.cuda_graph_batch_sizes if b <= cfg.max_num_seqs} | {1})),
        tensor_parallel_size=cfg.tensor_parallel_size, block_size=cfg.block_size, max_spec_slots=max_k,
        kv_budget_bytes=budget)


def _compute_dtype(cfg: EngineConfig, machine: Machine) -> torch.dtype:
    """``dtype="auto"`` with int8 activations (w8a8 / w4a8) on CPU is float32 even where the CPU
    computes in bf16: their losslessness rests on every op computing a row the same whatever the
    batch, which the row-by-row attention kernel gives in float32 only (and float32 activations
    are what the kernel quantizes anyway)."""
    if cfg.dtype == "auto" and machine.device.type == "cpu" and cfg.quantization in ROW_CONSISTENT_QUANTIZATIONS:
        return torch.float32
    return machine.resolve_dtype(cfg.dtype)


def _bf16_weights_float32_activations(cfg: EngineConfig, machine: Machine, model_path: str,
                                      tensor_parallel: bool) -> bool:
    """``dtype="auto"`` or ``"bfloat16"`` on a CPU with bf16 arithmetic, no quantization: the model
    is loaded in bf16, its linears keep their bf16 weights (``Bf16WeightLinear``, the same bytes per step as a
    bf16 model) and everything else computes in float32, which takes the fused float32 CPU ops and
    the row-by-row attention kernel. A user who asks for bf16 gets the same weights and bytes per
    step, with attention, norms and activations in the fused float32 ops rather than a chain of bf16
    torch ops, which costs every layer dtype conversions and unfused kernels. Only where the bf16
    kernel is the faster linear here and (the caller checks) the KV budget holds a max_model_len
    sequence in float32."""
    from specdec.models.gguf_quant import has_quantized_linears

    if (cfg.dtype not in BF16_WIDENING_DTYPES or machine.device.type != "cpu" or cfg.quantization is not None
            or tensor_parallel):
        return False
    if not machine.has("cpu_bf16") or has_quantized_linears(model_path):
        return False
    return machine.has("bf16_kernel_faster")


def _kv_fits(cfg: EngineConfig, bytes_per_block: int, max_model_len: int, max_k: int) -> bool:
    """Whether the CPU KV budget holds one max_model_len sequence at ``bytes_per_block`` (the target's
    alone: a float32 cache is twice a bf16 one, and an engine that starts as a bf16 model must
    still start)."""
    budget = cfg.kv_cache_memory if cfg.kv_cache_memory is not None else DEFAULT_CPU_KV_BYTES
    return budget // bytes_per_block >= blocks_per_sequence(cfg, max_model_len, max_k)


def attention_backend_name(cfg: EngineConfig, machine: Machine, dtype: torch.dtype) -> str:
    """``"auto"``: on CPU the row-by-row C++ attention for float32 (faster than the batched torch
    path at decode and verification, and the one int8 activations need), the torch path
    otherwise; Triton on CUDA (torch where Triton does not import)."""
    choice, cpu = cfg.attention_backend, machine.device.type == "cpu"
    if choice == "reference":
        return "reference"
    if choice == "rows" or (choice == "auto" and cpu and (
            cfg.quantization in ROW_CONSISTENT_QUANTIZATIONS or (dtype == torch.float32 and machine.has("rows_kernel")))):
        return "rows"
    if choice == "torch" or (choice == "auto" and machine.device.type != "cuda"):
        return "torch"
    if not machine.has("triton"):
        if choice == "triton":
            raise ValueError("attention_backend='triton' needs triton, which does not import here")
        return "torch"
    return "triton"
