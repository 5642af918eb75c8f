"""Kernel choices made by measuring on the machine at hand (never assumed from CPU flags), and the report
of every CPU kernel choice the engine makes (``cpu_kernel_choices``, printed by ``specdec bench``).

Measured here, once per process:
- ``bf16_amx_faster``: whether a bf16 pair-layout linear (``quantization.Bf16WeightLinear``) runs the AMX
  kernel or the AVX-512 pair kernel, at every row count (one kernel keeps a row's result independent of
  the call's rows).
- ``a8_amx_min_rows``: from how many rows a w4a8 / w8a8 linear runs the AMX path of the int8-activation
  kernel; both paths give the same values bit for bit, so the switch is by row count.
- ``a8_variant_plan``: which instruction sequence of the int8-activation kernel
  (``kernels.cpu.woq_a8_variants``: 512- or 256-bit VNNI, bf16 dot products; all equal bit for bit)
  runs at each row count, the fastest measured on a layer-shaped weight (``$SPECDEC_A8_KERNEL`` forces
  one); ``a8_row_ops`` gives the ops a layer binds.
``quantization.bf16_kernel_faster`` (the pair kernel against oneDNN's packed linear) is the third.
"""
from __future__ import annotations

import functools
import time
from typing import Callable

import torch

from specdec.kernels.cpu import amx_cpu, woq_a8_variants, woq_cpu

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
    cache), each call timed alone, the fastest call kept: another process can only add time to a call
    (a call preempted for a time slice reads several times its cost), so on a shared machine the median
    of a few calls can still hold a time slice while the fastest is the kernel's own cost."""
    xs = {m: torch.randn(m, k).to(dtype) for m in rows}
    samples = {name: {m: [] for m in rows} for name in calls}
    names = list(calls)
    turn = 0
    for p in range(passes):
        for m in rows:
            # each pass starts with another kernel, and each kernel's first call at a row count is
            # untimed: whichever kernel ran first would otherwise pay the threads' wake-up
            for name in names[p % len(names):] + names[:p % len(names)]:
                call = calls[name]
                call(turn % copies, xs[m])
                turn += 1
                for _ in range(calls_per_pass):
                    start = time.perf_counter()
                    call(turn % copies, xs[m])
                    samples[name][m].append(time.perf_counter() - start)
                    turn += 1
    return {name: {m: min(t) for m, t in per_rows.items()} for name, per_rows in samples.items()}


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


A8_AMX_ROWS = (1, 2, 4, 8, 16, 64)  # row counts at which the int8-activation kernels are compared


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


def a8_timing_weights(int4: bool) -> list[tuple]:
    """The kernel arguments (``woq_cpu.a8_kernel_args``) of copies of one [4096, 2048] int4 (group 128)
    or int8 (per channel) weight, 64 MB in all, so that the calls that walk them stream from memory."""
    from specdec.kernels.cpu.woq_format import quantize_int4, quantize_int8

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(4096, 2048, generator=gen) * 0.02
    one = woq_cpu.a8_kernel_args(woq_cpu.A8Weight.prepare(quantize_int4(w, INT4_GROUP_SIZE) if int4
                                                          else quantize_int8(w)))
    copies = 16 if int4 else 8
    return [tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in one) for _ in range(copies)]


# the row counts the int8-activation variants are timed at: a decode, verifications of K = 1, 3, 5, 7
# drafts, a tree's 16 nodes, a prefill chunk (A8_AMX_ROWS among them); a call of m rows runs the choice
# of the smallest of them >= m (past the last: the last)
A8_VARIANT_ROWS = (1, 2, 4, 6, 8, 16, 64)


def a8_build() -> str:
    """The build of the int8-activation kernel in use (``$SPECDEC_CPU_ISA`` or the best here): the key of
    every measured plan below, whose variant names differ between builds."""
    return woq_cpu.build_args(None, a8=True)[0]


def clear_a8_timings() -> None:
    """Forget every measured int8-activation plan (tests that fake the kernels or their clock)."""
    for cached in (_a8_times, _a8_amx_min_rows, _a8_measured_plan):
        cached.cache_clear()


def a8_times(int4: bool) -> dict[str, dict[int, float]] | None:
    """Seconds per call of each int8-activation variant that runs here (``woq_a8_variants``, AMX
    included) on ``a8_timing_weights``, at ``A8_VARIANT_ROWS`` rows; None where only one runs. One
    timing per build serves ``a8_amx_min_rows`` and ``a8_measured_plan``: at load, every second counts."""
    return _a8_times(int4, a8_build())


@functools.lru_cache(maxsize=None)
def _a8_times(int4: bool, build: str) -> dict[str, dict[int, float]] | None:
    ops = woq_a8_variants.variant_ops(int4)
    if len(ops) < 2:
        return None
    args = a8_timing_weights(int4)
    calls = {name: (lambda i, x, op=op: op(x, *args[i], None)) for name, op in ops.items()}
    return time_row_kernels(calls, 2048, A8_VARIANT_ROWS, passes=2, calls_per_pass=4, copies=len(args),
                            dtype=torch.float32)


def a8_amx_times(int4: bool) -> dict[str, dict[int, float]] | None:
    """``a8_times`` of the default (VNNI) path and the AMX one at ``A8_AMX_ROWS`` rows, as ``{"vnni": ...,
    "amx": ...}``; None where the AMX path cannot run here."""
    times = a8_times(int4)
    if times is None or woq_a8_variants.AMX not in times:
        return None
    vnni, amx = times[woq_a8_variants.default_variant()], times[woq_a8_variants.AMX]
    return {"vnni": {m: vnni[m] for m in A8_AMX_ROWS}, "amx": {m: amx[m] for m in A8_AMX_ROWS}}


def a8_amx_min_rows(int4: bool) -> int | None:
    """From how many rows a w4a8 (``int4``) or w8a8 linear runs the AMX path of the int8-activation kernel:
    measured here (``a8_amx_times``, ``min_rows_faster``); None: never (no AMX, or slower at every row
    count). Both paths give the same result bit for bit, so the switch by row count keeps every row's
    result independent of the call's rows."""
    return _a8_amx_min_rows(int4, a8_build())


@functools.lru_cache(maxsize=None)
def _a8_amx_min_rows(int4: bool, build: str) -> int | None:
    times = a8_amx_times(int4)
    return None if times is None else min_rows_faster(times, "amx", "vnni")


def pick_per_rows(seconds: dict[str, dict[int, float]], default: str, margin: float = 0.03) -> dict[int, str]:
    """Per measured row count, the fastest kernel of ``seconds`` (``{kernel: {rows: s}}``): ``default``
    unless another beats it by more than ``margin`` (a near-tie keeps the default). Kernels that give
    the same values bit for bit may be mixed by row count: a row's result stays the call's rows' own."""
    plan = {}
    for m in seconds[default]:
        best = min(seconds, key=lambda name: seconds[name][m])
        plan[m] = best if seconds[best][m] < (1 - margin) * seconds[default][m] else default
    return plan


def a8_measured_plan(int4: bool) -> dict[int, str]:
    """``pick_per_rows`` on ``a8_times`` without AMX (the default variant everywhere where it alone runs);
    AMX has its own rule, ``a8_amx_min_rows``."""
    return _a8_measured_plan(int4, a8_build())


@functools.lru_cache(maxsize=None)
def _a8_measured_plan(int4: bool, build: str) -> dict[int, str]:
    times = a8_times(int4)
    default = woq_a8_variants.default_variant()
    others = {name: t for name, t in (times or {}).items() if name != woq_a8_variants.AMX}
    return pick_per_rows(others, default) if len(others) > 1 else {m: default for m in A8_VARIANT_ROWS}


def a8_variant_plan(int4: bool) -> dict[int, str]:
    """Which variant (``woq_a8_variants``) runs a w4a8 (``int4``) or w8a8 linear at each of
    ``A8_VARIANT_ROWS``: the measured fastest (``a8_measured_plan``), AMX from ``a8_amx_min_rows`` on;
    ``$SPECDEC_A8_KERNEL``: that variant at every row count where it runs the format (else the
    default)."""
    forced = woq_a8_variants.forced_variant()
    if forced is not None:
        name = forced if forced in woq_a8_variants.variant_ops(int4) else woq_a8_variants.default_variant()
        return {m: name for m in A8_VARIANT_ROWS}
    plan = dict(a8_measured_plan(int4))
    amx_rows = a8_amx_min_rows(int4)
    return {m: woq_a8_variants.AMX if amx_rows and m >= amx_rows else name for m, name in plan.items()}


def a8_row_ops(int4: bool) -> tuple:
    """The op ``(x, *woq_cpu.a8_kernel_args(w), bias)`` a w4a8 / w8a8 linear runs for a call of m rows at
    index m, m = 0 .. ``A8_VARIANT_ROWS[-1]`` (more rows: the last), from ``a8_variant_plan``."""
    ops, plan = woq_a8_variants.variant_ops(int4), a8_variant_plan(int4)
    return tuple(ops[plan[next(r for r in A8_VARIANT_ROWS if r >= max(m, 1))]]
                 for m in range(A8_VARIANT_ROWS[-1] + 1))


def describe_plan(plan: dict[int, str]) -> str:
    """``{1: "a", 2: "a", 3: "b", 16: "b"}`` -> ``"a at 1-2 rows, b at 3-16"``: runs of one variant."""
    runs: list[list] = []
    for m, name in sorted(plan.items()):
        if runs and runs[-1][0] == name:
            runs[-1][2] = m
        else:
            runs.append([name, m, m])
    parts = [f"{name} at {lo}-{hi}" if lo != hi else f"{name} at {lo}" for name, lo, hi in runs]
    return ", ".join(parts) + " rows"


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
        forced = woq_a8_variants.forced_variant()
        for name, int4 in (("w4a8", True), ("w8a8", False)):
            if forced is not None:
                choices[name] = f"{base}: {describe_plan(a8_variant_plan(int4))} ({woq_a8_variants.FORCE_ENV})"
                continue
            # the measured plan where more than one variant runs here, then AMX's threshold
            measured = len(woq_a8_variants.variant_ops(int4, amx=False)) > 1
            plan = f": {describe_plan(a8_measured_plan(int4))}" if measured else ""
            rows = a8_amx_min_rows(int4)
            choices[name] = base + plan + (f", AMX tiles from {rows} rows" if rows else
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
