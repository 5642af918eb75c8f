"""Kernel choices made by measuring on the machine at hand (never assumed from CPU flags), and the report
of every CPU kernel choice the engine makes (``cpu_kernel_choices``, printed by ``specdec bench``).

Measured here, once per process:
- ``bf16_amx_faster``: whether a bf16 pair-layout linear (``quantization.Bf16WeightLinear``) runs the AMX
  kernel or the AVX-512 pair kernel, at every row count (one kernel keeps a row's result independent of
  the call's rows).
- ``a8_amx_min_rows``: from how many rows a w4a8 / w8a8 linear runs the AMX path of the int8-activation
  kernel; both paths give the same values bit for bit, so the switch is by row count.
``quantization.bf16_kernel_faster`` (the pair kernel against oneDNN's packed linear) is the third.
"""
from __future__ import annotations

import functools
import statistics
import time
from typing import Callable

import torch

from specdec.kernels.cpu import amx_cpu, woq_cpu

INT4_GROUP_SIZE = 128  # quantization.INT4_GROUP_SIZE: the group the measured int4 weight uses


VERIFY_ROWS = 8  # the row count that stands for a verification step (K = 7 drafts) when kernels are compared


def pick_row_kernel(seconds: dict[str, dict[int, float]], tolerance: float = 0.1) -> str:
    """The kernel to run at every row count, from measured seconds per call ``{kernel: {rows: s}}`` (rows
    1 and ``VERIFY_ROWS``): the fastest at ``VERIFY_ROWS`` rows among those within ``tolerance`` of the
    fastest one-row time. One kernel for all row counts keeps a row's result independent of the call's
    row count (kernels sum in different orders); a plain decode step costs at most ``tolerance`` more so
    that a verification costs what the best kernel charges for it."""
    best_one = min(t[1] for t in seconds.values())
    near = {name: t for name, t in seconds.items() if t[1] <= (1 + tolerance) * best_one}
    return min(near, key=lambda name: near[name][VERIFY_ROWS])


def time_row_kernels(calls: dict[str, Callable[[int, torch.Tensor], object]], k: int,
                     rows: tuple[int, ...] = (1, VERIFY_ROWS), passes: int = 5, calls_per_pass: int = 8,
                     copies: int = 4, dtype: torch.dtype = torch.bfloat16) -> dict[str, dict[int, float]]:
    """Seconds per call of each ``calls[name](copy index, x)`` at each row count: the kernels alternate
    over ``passes`` passes of ``calls_per_pass`` calls that walk ``copies`` weights (so no weight stays in
    cache), each call timed alone, the median call kept (on a shared machine a call a neighbour's
    process preempted is an outlier, not the kernel's cost)."""
    xs = {m: torch.randn(m, k).to(dtype) for m in rows}
    samples = {name: {m: [] for m in rows} for name in calls}
    turn = 0
    for _ in range(passes):
        for m in rows:
            for name, call in calls.items():
                for _ in range(calls_per_pass):
                    start = time.perf_counter()
                    call(turn % copies, xs[m])
                    samples[name][m].append(time.perf_counter() - start)
                    turn += 1
    return {name: {m: statistics.median(t) for m, t in per_rows.items()} for name, per_rows in samples.items()}


@functools.lru_cache(maxsize=1)
def bf16_amx_times() -> dict[str, dict[int, float]] | None:
    """Seconds per call of the AVX-512 pair kernel and the AMX kernel on a bf16 [4096, 2048] weight in pair
    layout (4 copies, 64 MB), at 1 and ``VERIFY_ROWS`` rows; None where either cannot run here."""
    if not (amx_cpu.available() and woq_cpu.bf16_pairs_available()):
        return None
    weights = [woq_cpu.pack_bf16_pairs(torch.full((4096, 2048), 0.01, dtype=torch.bfloat16)) for _ in range(4)]
    ops, amx = woq_cpu.extension(), amx_cpu.extension()
    return time_row_kernels({"avx512_bf16": lambda i, x: ops.bf16_pairs_linear(x, weights[i], None),
                             "amx": lambda i, x: amx.amx_bf16_linear(x, weights[i], None)}, 2048)


@functools.lru_cache(maxsize=1)
def bf16_amx_faster() -> bool:
    """Whether ``Bf16WeightLinear`` runs the AMX kernel (``amx_cpu.amx_bf16_linear``) on its pair-layout
    weight instead of the AVX-512 pair kernel: measured here (``bf16_amx_times``, ``pick_row_kernel``),
    never assumed from the CPU flags. ``SPECDEC_DISABLE_AMX=1`` turns it off."""
    times = bf16_amx_times()
    return times is not None and pick_row_kernel(times) == "amx"


A8_AMX_ROWS = (1, 2, 4, 8, 16)  # row counts at which the int8-activation kernels are compared


def min_rows_faster(seconds: dict[str, dict[int, float]], fast: str, slow: str, margin: float = 0.05) -> int | None:
    """The smallest measured row count from which ``fast`` beats ``slow`` by more than ``margin`` at every
    larger measured row count too (a threshold, so a noisy middle point cannot interleave the two, and a
    near-tie keeps ``slow``); None if it never does."""
    rows = sorted(seconds[fast])
    threshold = None
    for m in reversed(rows):
        if seconds[fast][m] >= (1 - margin) * seconds[slow][m]:
            break
        threshold = m
    return threshold


@functools.lru_cache(maxsize=None)
def a8_amx_times(int4: bool) -> dict[str, dict[int, float]] | None:
    """Seconds per call of the int8-activation kernel's VNNI and AMX paths (``amx_cpu.extension_a8``) on a
    [4096, 2048] int4 (group 128) or int8 (per channel) weight, 4 copies, at ``A8_AMX_ROWS`` rows; None
    where the AMX path cannot run here."""
    from specdec.kernels.cpu.woq_format import quantize_int4, quantize_int8

    ops = amx_cpu.extension_a8()
    if ops is None:
        return None
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(4096, 2048, generator=gen) * 0.02
    one = woq_cpu.a8_kernel_args(woq_cpu.A8Weight.prepare(quantize_int4(w, INT4_GROUP_SIZE) if int4
                                                          else quantize_int8(w)))
    copies = 16 if int4 else 8  # 64 MB in all
    args = [tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in one) for _ in range(copies)]
    return time_row_kernels({"vnni": lambda i, x: ops.a8_linear(x, *args[i], None),
                             "amx": lambda i, x: ops.a8_linear_amx(x, *args[i], None)}, 2048, A8_AMX_ROWS,
                            copies=copies, dtype=torch.float32)


@functools.lru_cache(maxsize=None)
def a8_amx_min_rows(int4: bool) -> int | None:
    """From how many rows a w4a8 (``int4``) or w8a8 linear runs the AMX path of the int8-activation kernel:
    measured here (``a8_amx_times``, ``min_rows_faster``); None: never (no AMX, or slower at every row
    count). Both paths give the same result bit for bit, so the switch by row count keeps every row's
    result independent of the call's rows."""
    times = a8_amx_times(int4)
    return None if times is None else min_rows_faster(times, "amx", "vnni")


def cpu_kernel_choices() -> dict[str, str]:
    """Which kernel runs each CPU linear format and the attention on this machine, as the engine chooses
    them (the measured choices are measured now where no engine has yet, once per process): what
    ``specdec bench`` prints at the start of a run and records in its JSON."""
    from specdec.layers.quantization import _can_pack, bf16_kernel_faster
    from specdec.worker.device import cpu_supports_bf16

    choices: dict[str, str] = {}
    isas = woq_cpu.cpu_isas()
    choices["int8, int4 (weight-only)"] = f"specdec woq ({isas[0]})" if woq_cpu.available() else \
        "reference (dequantize + F.linear)"
    if woq_cpu.extension_a8() is not None:
        a8_isa = woq_cpu.cpu_isas(a8=True)[0]
        base = f"specdec a8 ({a8_isa}{' VNNI' if a8_isa == 'avx512' else ''})"
        for name, int4 in (("w4a8", True), ("w8a8", False)):
            rows = a8_amx_min_rows(int4)
            choices[name] = base + (f", AMX tiles from {rows} rows" if rows else
                                    (", AMX measured slower" if amx_cpu.extension_a8() is not None else ""))
    else:
        choices["w4a8, w8a8"] = "reference (int8 activations in torch)"
    if woq_cpu.bf16_pairs_available():
        pairs = "AMX tiles (pair layout)" if bf16_amx_faster() else "avx512_bf16 pair kernel"
    else:
        pairs = "float32 kernel on bf16 weights" if woq_cpu.available() else "F.linear"
    onednn = "oneDNN packed" + (" (AMX)" if amx_cpu.cpu_has_amx() else "")
    faster = _can_pack(torch.bfloat16, torch.device("cpu")) and bf16_kernel_faster()
    widened = f"bf16 weights, float32 activations: {pairs}"
    if cpu_supports_bf16():
        choices['dtype="auto", no quantization'] = widened if faster else f"bfloat16 model: {onednn}"
    else:
        choices['dtype="auto", no quantization'] = f"float32 model, bf16-exact weights kept in bf16: {pairs}"
    if _can_pack(torch.bfloat16, torch.device("cpu")):
        # dtype="bfloat16" widens as "auto" does wherever the bf16-weight kernel is the faster linear
        choices['dtype="bfloat16"'] = widened if faster and cpu_supports_bf16() else f"bfloat16 model: {onednn}"
    choices["attention"] = "rows kernel (float32 and w8a8/w4a8), torch SDPA (bfloat16)" if _rows_kernel() \
        else "torch SDPA"
    return choices


def _rows_kernel() -> bool:
    from specdec.kernels.cpu import cpp_build
    from specdec.kernels.cpu.attention_rows import extension

    return not cpp_build.disabled(woq_cpu.DISABLE_ENV) and bool(woq_cpu.cpu_isas()) and extension() is not None
