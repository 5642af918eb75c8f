"""What a verification row costs on this CPU, per weight format: t(M) / t(1) of one Qwen2.5-1.5B layer's
linears (qkv 2048x1536, o 1536x1536, gate_up 17920x1536, down 1536x8960; random weights) as the engine's
own layers run them, with each kernel choice forced (AVX-512 only, AMX) and as measured at load.

    PYTHONPATH=. python scripts/cpu_verify_rows.py --output-json bench_results/cpu_survey_spr_amx.json

Copies of the layer's linears (>= 160 MB in all) are walked in turn so a call rarely finds its weights in
cache; the variants alternate within each pass; each call is timed alone and the median kept.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from types import SimpleNamespace

import torch
from torch import nn

from specdec.bench.report import cpu_header, result_header, write_json
from specdec.bench.roofline import measure_bandwidth, weight_bytes
from specdec.layers import cpu_kernel_choice, quantization

SHAPES = {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960)}
ROWS = (1, 2, 4, 7, 8, 16, 32)
TOTAL_BYTES = 160 << 20


def layer_linears(make) -> nn.ModuleList:
    gen = torch.Generator().manual_seed(0)
    linears = []
    for n, k in SHAPES.values():
        lin = nn.Linear(k, n, bias=False)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n, k, generator=gen) * 0.02)
        linears.append(make(lin))
    return nn.ModuleList(linears)


def variants() -> dict[str, dict[str, tuple]]:
    """format -> variant -> (make linear, bf16 AMX forced, a8 AMX rows forced, activation dtype)."""
    bf16 = lambda lin: quantization.Bf16WeightLinear(lin.to(torch.bfloat16))  # noqa: E731
    packed = lambda lin: quantization.PackedLinear(lin.to(torch.bfloat16))  # noqa: E731
    measured = "measured"
    return {
        "bf16": {"oneDNN packed": (packed, None, None, torch.bfloat16),
                 "avx512_bf16 pair kernel": (bf16, False, None, torch.float32),
                 "AMX (pair layout)": (bf16, True, None, torch.float32),
                 "engine choice": (bf16, measured, None, torch.float32)},
        "w8a8": {"VNNI": (quantization.W8A8Linear, None, 0, torch.float32),
                 "AMX": (quantization.W8A8Linear, None, 1, torch.float32),
                 "engine choice": (quantization.W8A8Linear, None, measured, torch.float32)},
        "w4a8": {"VNNI": (quantization.W4A8Linear, None, 0, torch.float32),
                 "AMX": (quantization.W4A8Linear, None, 1, torch.float32),
                 "engine choice": (quantization.W4A8Linear, None, measured, torch.float32)},
        "int8": {"woq AVX-512": (quantization.Int8Linear, None, None, torch.float32)},
        "int4": {"woq AVX-512": (quantization.Int4Linear, None, None, torch.float32)},
    }


def build(make, bf16_amx, a8_rows, dtype):
    """The layer's linears made with the kernel choices forced (None: as measured), and its copies."""
    saved = cpu_kernel_choice.bf16_amx_faster, cpu_kernel_choice.a8_amx_min_rows
    if bf16_amx not in (None, "measured"):
        cpu_kernel_choice.bf16_amx_faster = lambda: bf16_amx
    if a8_rows not in (None, "measured"):
        cpu_kernel_choice.a8_amx_min_rows = lambda int4: a8_rows or None
    try:
        first = layer_linears(make)
        nbytes = weight_bytes(first).total
        copies = [first]
        for _ in range(max(1, -(-TOTAL_BYTES // nbytes)) - 1):
            try:
                copies.append(copy.deepcopy(first))
            except NotImplementedError:  # oneDNN's packed weights are opaque: pack again
                copies.append(layer_linears(make))
        xs = {m: [torch.randn(m, k).to(dtype) for _, k in SHAPES.values()] for m in ROWS}
        for layer in copies:  # bind each layer's kernel (and its forced choice) now
            for lin, x in zip(layer, xs[1]):
                lin(x)
        return copies, nbytes
    finally:
        cpu_kernel_choice.bf16_amx_faster, cpu_kernel_choice.a8_amx_min_rows = saved


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--calls", type=int, default=6)
    p.add_argument("--formats", default="bf16,w8a8,w4a8,int8,int4")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    print(cpu_header(SimpleNamespace(device="cpu")), flush=True)
    results = {}
    for fmt in args.formats.split(","):
        built = {name: (*build(make, amx, rows, dtype), dtype)
                 for name, (make, amx, rows, dtype) in variants()[fmt].items()}
        samples = {name: {m: [] for m in ROWS} for name in built}
        bandwidths = []
        for _ in range(args.passes):
            bandwidths.append(measure_bandwidth(256 << 20, repeats=3))
            for m in ROWS:
                for name, (copies, _, dtype) in built.items():
                    xs = [torch.randn(m, k).to(dtype) for _, k in SHAPES.values()]
                    for i in range(args.calls):
                        layer = copies[i % len(copies)]
                        start = time.perf_counter()
                        for lin, x in zip(layer, xs):
                            lin(x)
                        samples[name][m].append(time.perf_counter() - start)
        results[fmt] = {}
        for name, (copies, nbytes, _) in built.items():
            t = {m: statistics.median(v) for m, v in samples[name].items()}
            results[fmt][name] = {"seconds": {str(m): s for m, s in t.items()},
                                  "t_over_t1": {str(m): s / t[1] for m, s in t.items()},
                                  "gb_per_s_m1": nbytes / t[1] / 1e9, "weight_bytes": nbytes}
            print(f"{fmt:5s} {name:24s} M=1 {1e3 * t[1]:7.2f} ms ({nbytes / t[1] / 1e9:5.1f} GB/s)  " +
                  "  ".join(f"t{m}/t1 {t[m] / t[1]:.2f}" for m in ROWS[1:]), flush=True)
        results[fmt]["copy_gb_per_s"] = statistics.median(bandwidths) / 1e9
        del built
    header = result_header(SimpleNamespace(bench_command="cpu-verify-rows"), "cpu_verify_rows",
                           None, torch.device("cpu"))
    header["command"] = "PYTHONPATH=. python scripts/cpu_verify_rows.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "output_json")
    write_json(header | {"shapes": SHAPES, "rows": list(ROWS), "results": results}, args.output_json)
    if args.output_json:
        print(json.dumps({"written": args.output_json}))


if __name__ == "__main__":
    main()
