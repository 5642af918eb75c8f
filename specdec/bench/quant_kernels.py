"""``specdec bench quant-kernels``: the CPU linear kernels (int8 / int4 weight-only, int8 activations,
bf16 weights) against the copy bandwidth, at each row count M a decode (1) or a verification (K + 1,
a tree's nodes: up to 32) runs.

For each kernel, shape (N outputs x K inputs) and activation row count M, the effective
bandwidth is the weight bytes the kernel must stream (int8: N*K + scales; int4: N*K/2 + scales
and zero points; bf16: 2*N*K) over its time, reported in GB/s and as a ratio to the
single-thread copy bandwidth measured in the same process right before (read + written bytes,
as ``roofline.py`` counts), with t(M)/t(1): what a verification row costs on this CPU.
Each weight is copied enough times that one pass over the copies exceeds ``CACHE_BYTES``,
and successive calls walk the copies, so a call rarely finds its weight in cache. A kernel
meets the bar when it reaches 0.70 of the copy bandwidth at M=1 and its M=7 time (a K=6
verification) stays within 1.3x its M=1 time. The AMX paths (``kernels.cpu.amx_cpu``) are timed
where the CPU has AMX; the int8-activation kernel's variants (``kernels.cpu.woq_a8_variants``) where
they run, with "load-time choice" (the variant the engine picks per row count, printed first);
third-party kernels (torchao, zentorch) when importable.
"""
from __future__ import annotations

import argparse
import time
import warnings

import torch

from specdec.bench.report import median, result_header, run_benchmark
from specdec.bench.roofline import measure_bandwidth

SHAPES = ((1536, 1536), (256, 1536), (8960, 1536), (1536, 8960), (4096, 4096))  # (N, K): Qwen2.5-1.5B, 4096^2
ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 16, 32)
CACHE_BYTES = 256 << 20  # the copies of one weight together exceed this (beyond most L3s)
BAR_ROWS = 7  # the verification the bar prices: K = 6 drafts


def add_parser(sub):
    p = sub.add_parser("quant-kernels", help="CPU linear kernels (int8/int4, int8 activations, bf16, AMX): "
                                             "effective GB/s vs copy GB/s per row count")
    p.add_argument("--kernels", default=None, help="comma-separated subset of the kernel names")
    p.add_argument("--shapes", default=None, help="NxK,NxK,... (default: Qwen2.5-1.5B shapes and 4096x4096)")
    p.add_argument("--rows", default=",".join(map(str, ROWS)))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="activation dtype")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="repetitions (the median is reported)")
    p.add_argument("--group-size", type=int, default=128, help="int4 group size along K (32: GGUF Q4_0)")
    p.add_argument("--gbs", action="store_true", help="per-M cells in effective GB/s, not the ratio to copy GB/s")
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=run)
    return p


def _int8_weights(w: torch.Tensor, group_size: int | None):
    from specdec.kernels.cpu.woq_format import quantize_int8

    return quantize_int8(w, group_size)


def candidate_kernels(group_size: int) -> dict:
    """name -> (format, prepare(w [N, K] float32, dtype) -> (fn(x) -> y, weight bytes)). Formats:
    int8 per output channel, int4 with ``group_size`` groups along K."""
    from specdec.kernels.cpu import woq_cpu
    from specdec.kernels.cpu.woq_format import quantize_int4, quantize_int8

    def torch_int8pack(w, dtype):
        q = quantize_int8(w, None)
        scales = q.scales[:, 0].to(dtype).contiguous()
        return (lambda x: torch._weight_int8pack_mm(x, q.qweight, scales)), q.nbytes

    def torch_int4pack(w, dtype):
        q = quantize_int4(w, group_size)
        # PyTorch's format: [N, K] int32 values 0..15, scale_and_zero [K/G, N, 2] with w = (q - 8) * s + zero
        packed = torch._convert_weight_to_int4pack_for_cpu(q.unpacked().to(torch.int32), 1)
        zero = 8 * q.scales + q.offsets  # [N, G]: q s + o = (q - 8) s + (8 s + o)
        sz = torch.stack([q.scales, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)
        return (lambda x: torch._weight_int4pack_mm_for_cpu(x, packed, group_size, sz)), q.nbytes

    def dequant_reference(fmt):
        def prepare(w, dtype):
            q = quantize_int8(w, None) if fmt == "int8" else quantize_int4(w, group_size)
            return (lambda x: torch.nn.functional.linear(x, q.dequantize(x.dtype))), q.nbytes
        return prepare

    def ours(fmt):
        def prepare(w, dtype):
            q = quantize_int8(w, None) if fmt == "int8" else quantize_int4(w, group_size)
            return (lambda x: woq_cpu.linear(x, q)), q.nbytes
        return prepare

    def ours_a8(fmt):
        def prepare(w, dtype):
            q = quantize_int8(w, None) if fmt == "int8" else quantize_int4(w, group_size)
            aw = woq_cpu.A8Weight.prepare(q)
            return (lambda x: woq_cpu.linear_a8(x, aw)), q.nbytes
        return prepare

    kernels = {
        "torch._weight_int8pack_mm": ("int8", torch_int8pack),
        "torch._weight_int4pack_mm_for_cpu": ("int4", torch_int4pack),
        "dequantize + F.linear (int8)": ("int8", dequant_reference("int8")),
        "dequantize + F.linear (int4)": ("int4", dequant_reference("int4")),
    }
    if woq_cpu.available():
        isa = woq_cpu.cpu_isas()[0]
        kernels[f"specdec woq int8 ({isa})"] = ("int8", ours("int8"))
        kernels[f"specdec woq int4 ({isa})"] = ("int4", ours("int4"))
    if woq_cpu.extension_a8() is not None:
        isa = woq_cpu.cpu_isas(a8=True)[0]
        kernels[f"specdec w8a8 ({isa})"] = ("int8", ours_a8("int8"))
        kernels[f"specdec w4a8 ({isa})"] = ("int4", ours_a8("int4"))
        kernels.update(_a8_variant_kernels(group_size))
    kernels.update(_bf16_kernels())
    kernels.update(_amx_a8_kernels(group_size))
    kernels.update(_third_party(group_size))
    return kernels


def _bf16_kernels() -> dict:
    """bf16 weights: oneDNN's packed linear (what a bf16 model's ``PackedLinear`` runs; AMX where the CPU
    has it), the AVX-512 pair kernel and the AMX tile kernel on the pair layout (``Bf16WeightLinear``)."""
    from specdec.kernels.cpu import amx_cpu, woq_cpu
    from specdec.layers.quantization import _can_pack

    out = {}
    if _can_pack(torch.bfloat16, torch.device("cpu")):
        def onednn(w, dtype):
            packed = torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16), 1)
            return (lambda x: torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), packed, None, "none", [], "")), \
                2 * w.numel()
        out["oneDNN packed bf16" + (" (AMX)" if amx_cpu.cpu_has_amx() else "")] = ("bf16", onednn)
    if woq_cpu.bf16_pairs_available():
        def pairs(w, dtype):
            packed = woq_cpu.pack_bf16_pairs(w.to(torch.bfloat16))
            return (lambda x: woq_cpu.bf16_pairs_linear(x, packed)), 2 * w.numel()
        out["specdec bf16 pairs (avx512_bf16)"] = ("bf16", pairs)
    if amx_cpu.available():
        def amx(w, dtype):
            packed = woq_cpu.pack_bf16_pairs(w.to(torch.bfloat16))
            return (lambda x: amx_cpu.amx_bf16_linear(x, packed)), 2 * w.numel()
        out["specdec bf16 pairs (AMX)"] = ("bf16", amx)
    return out


def _a8_variant_kernels(group_size: int) -> dict:
    """The int8-activation kernel's other variants (the same values as ``linear_a8``, bit for bit) and
    the load-time choice: the variant ``cpu_kernel_choice.a8_row_ops`` binds for each row count."""
    from specdec.kernels.cpu import woq_a8_variants, woq_cpu
    from specdec.kernels.cpu.woq_format import quantize_int4, quantize_int8
    from specdec.layers import cpu_kernel_choice

    def prepare_with(int4: bool, op=None):
        def prepare(w, dtype):
            q = quantize_int4(w, group_size) if int4 else quantize_int8(w, None)
            args = woq_cpu.a8_kernel_args(woq_cpu.A8Weight.prepare(q))
            if op is not None:
                return (lambda x: op(x, *args, None)), q.nbytes
            by_rows = cpu_kernel_choice.a8_row_ops(int4)
            return (lambda x: by_rows[min(x.numel() // w.shape[1], len(by_rows) - 1)](x, *args, None)), q.nbytes
        return prepare

    out = {}
    for fmt, int4 in (("int8", False), ("int4", True)):
        label = "w4a8" if int4 else "w8a8"
        for name, op in woq_a8_variants.variant_ops(int4, amx=False).items():
            if name != woq_a8_variants.default_variant():
                out[f"specdec {label} ({name})"] = (fmt, prepare_with(int4, op))
        out[f"specdec {label} (load-time choice)"] = (fmt, prepare_with(int4))
    return out


def a8_selection() -> dict[str, str]:
    """The int8-activation variant the engine runs at each row count, per format (measured now, at this
    process's thread count, where no layer has yet)."""
    from specdec.kernels.cpu import woq_cpu
    from specdec.layers import cpu_kernel_choice

    if woq_cpu.extension_a8() is None:
        return {}
    return {fmt: cpu_kernel_choice.describe_plan(cpu_kernel_choice.a8_variant_plan(int4))
            for fmt, int4 in (("w4a8", True), ("w8a8", False))}


def _amx_a8_kernels(group_size: int) -> dict:
    """The AMX path of the int8-activation kernel (the same values as its VNNI path, bit for bit)."""
    from specdec.kernels.cpu import amx_cpu, woq_cpu
    from specdec.kernels.cpu.woq_format import quantize_int4, quantize_int8

    ops = amx_cpu.extension_a8()
    if ops is None:
        return {}

    def amx_a8(fmt):
        def prepare(w, dtype):
            q = quantize_int8(w, None) if fmt == "int8" else quantize_int4(w, group_size)
            args = woq_cpu.a8_kernel_args(woq_cpu.A8Weight.prepare(q))
            return (lambda x: ops.a8_linear_amx(x, *args, None)), q.nbytes
        return prepare
    return {"specdec w8a8 (AMX)": ("int8", amx_a8("int8")), "specdec w4a8 (AMX)": ("int4", amx_a8("int4"))}


def _third_party(group_size: int) -> dict:
    out = {}
    try:
        import zentorch  # noqa: F401
        from specdec.kernels.cpu.woq_format import quantize_int4

        def zen_int4(w, dtype):
            q = quantize_int4(w, group_size)
            signed = (q.unpacked().to(torch.int32) - 8).to(torch.int8)  # symmetric: zero 8
            packed = torch.ops.zentorch.zentorch_woq_repack_weight(signed).transpose(0, 1)
            scales = q.scales.transpose(0, 1).contiguous().to(dtype)
            return (lambda x: torch.ops.zentorch.zentorch_woq_linear(x, packed, scales, None, None)), q.nbytes
        out["zentorch_woq_linear (int4)"] = ("int4", zen_int4)
    except ImportError as e:
        warnings.warn(f"zentorch not importable, not timed: {e}", stacklevel=2)
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        def ao_int8(w, dtype):
            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False).to(dtype)
            lin.weight.data.copy_(w)
            quantize_(lin, Int8WeightOnlyConfig())
            return lin, w.numel() + 4 * w.shape[0]
        out["torchao Int8WeightOnly"] = ("int8", ao_int8)
    except ImportError as e:
        warnings.warn(f"torchao not importable, not timed: {e}", stacklevel=2)
    return out


def time_kernel(prepare, n: int, k: int, rows, dtype: torch.dtype, pass_seconds: float = 0.05) -> dict:
    """Seconds per call for each M (median of 3 timed passes over the rotating copies, each pass
    about ``pass_seconds`` long and at least 5 calls)."""
    w = torch.randn(n, k) * 0.02
    fn, nbytes = prepare(w, dtype)
    num_copies = max(2, -(-CACHE_BYTES // nbytes))
    fns = [fn] + [prepare(w, dtype)[0] for _ in range(num_copies - 1)]
    out = {}
    for m in rows:
        x = torch.randn(m, k).to(dtype)
        t = time.perf_counter()
        for f in fns if m == rows[0] else fns[:1]:  # warm-up: first-call costs, page faults
            f(x)
        per_call = (time.perf_counter() - t) / (num_copies if m == rows[0] else 1)
        num_calls = max(3, int(pass_seconds / per_call))
        passes = []
        for _ in range(3):
            t = time.perf_counter()
            for i in range(num_calls):
                fns[i % num_copies](x)
            passes.append((time.perf_counter() - t) / num_calls)
        out[m] = median(passes)
    return {"seconds": out, "weight_bytes": nbytes}


def measure(args) -> dict:
    torch.set_num_threads(args.num_threads)
    dtype = getattr(torch, args.dtype)
    rows = [int(r) for r in args.rows.split(",")]
    shapes = SHAPES if not args.shapes else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    kernels = candidate_kernels(args.group_size)
    if args.kernels:
        unknown = [name for name in args.kernels.split(",") if name not in kernels]
        if unknown:
            raise SystemExit(f"--kernels: unknown {unknown}; this machine has {sorted(kernels)}")
        kernels = {name: kernels[name] for name in args.kernels.split(",")}
    gbs = getattr(args, "gbs", False)
    selection = a8_selection() if any(name.startswith(("specdec w4a8", "specdec w8a8")) for name in kernels) else {}
    for fmt, plan in selection.items():
        print(f"load-time selection, {fmt}: {plan}", flush=True)
    results = []
    for name, (fmt, prepare) in kernels.items():
        for n, k in shapes:
            reps = []
            for _ in range(args.repeats):
                copy_bw = measure_bandwidth(256 << 20, repeats=3)
                try:
                    t = time_kernel(prepare, n, k, rows, dtype)
                except (RuntimeError, NotImplementedError) as e:
                    reps = None
                    results.append({"kernel": name, "format": fmt, "n": n, "k": k, "error": str(e).splitlines()[0]})
                    break
                reps.append({str(m): t["weight_bytes"] / s / copy_bw for m, s in t["seconds"].items()}
                            | {f"gbs{m}": t["weight_bytes"] / s / 1e9 for m, s in t["seconds"].items()}
                            | {f"t{m}/t1": s / t["seconds"][rows[0]] for m, s in t["seconds"].items()}
                            | {"copy_gbs": copy_bw / 1e9})
            if reps:
                row = {"kernel": name, "format": fmt, "n": n, "k": k,
                       "ratio": {str(m): median(r[str(m)] for r in reps) for m in rows},
                       "gb_per_s": {str(m): median(r[f"gbs{m}"] for r in reps) for m in rows},
                       "time_vs_m1": {str(m): median(r[f"t{m}/t1"] for r in reps) for m in rows},
                       "copy_gbs": median(r["copy_gbs"] for r in reps)}
                results.append(row)
                print(render_row(row, rows, gbs), flush=True)
    copy_gbs = median(r["copy_gbs"] for r in results if "copy_gbs" in r) if results else None
    return result_header(args, "quant_kernels", copy_gbs * 1e9 if copy_gbs else None) | {
        "rows": rows, "dtype": args.dtype, "num_threads": args.num_threads, "group_size": args.group_size,
        "repeats": args.repeats, "cells": "gb_per_s" if gbs else "ratio", "a8_selection": selection,
        "results": results}


def _t(r: dict, m: int) -> float:
    return r["time_vs_m1"].get(str(m), float("nan"))


def render_row(r: dict, rows, gbs: bool = False) -> str:
    if "error" in r:
        return f"| {r['kernel']} | {r['n']}x{r['k']} | error: {r['error'][:80]} |"
    cells = r["gb_per_s"] if gbs else r["ratio"]
    ratios = " | ".join(f"{cells[str(m)]:.2f}" for m in rows)
    gbs = r.get("gb_per_s", {}).get(str(rows[0]))
    t_bar = _t(r, BAR_ROWS)
    meets = r["ratio"][str(rows[0])] >= 0.70 and t_bar <= 1.3
    return (f"| {r['kernel']} | {r['n']}x{r['k']} | {'-' if gbs is None else f'{gbs:.1f}'} | {ratios} | {t_bar:.2f} | "
            f"{_t(r, 16):.2f} | {_t(r, 32):.2f} | {r['copy_gbs']:.1f} | {'yes' if meets else 'no'} |")


def render(data: dict) -> str:
    rows = data["rows"]
    gbs = data.get("cells") == "gb_per_s"
    per_m = "effective GB/s (weight bytes streamed / time)" if gbs else \
        "effective GB/s (weight bytes streamed / time) over the single-thread copy GB/s measured just before"
    note = (f"Effective GB/s at M={rows[0]}, then {per_m}, per row count M; activations {data['dtype']}, "
            f"{data['num_threads']} thread(s), int4 group {data['group_size']}, median of {data.get('repeats', 3)}; "
            f"bar: >= 0.70 at M=1 and t(M={BAR_ROWS}) <= 1.3 t(M=1).\n\n")
    for fmt, plan in data.get("a8_selection", {}).items():
        note += f"Load-time selection, {fmt}: {plan}.\n\n"
    for source in data.get("merged_from", []):  # rows of other runs of this command, same machine and day
        note += f"Rows of {source['kernels']}: `{source['command']}` ({source['date']}).\n\n"
    head = note + (f"| kernel | NxK | GB/s M={rows[0]} | " + " | ".join(f"M={m}" for m in rows)
                   + f" | t(M={BAR_ROWS})/t(M=1) | t(M=16)/t(M=1) | t(M=32)/t(M=1) | copy GB/s | meets bar |\n"
                   + "|---" * (len(rows) + 8) + "|")
    return "\n".join([head] + [render_row(r, rows, gbs) for r in data["results"]])


def run(args: argparse.Namespace) -> int:
    return run_benchmark(args, measure, render)
