#!/usr/bin/env python
"""Prompt (prefill) rows through the int8-activation CPU kernel: the AMX path of the working tree
(``a8_linear_amx``), the AMX path of a git revision and the VNNI kernel (``a8_linear``), side by side
in one process, per weight shape, row count and thread count. Needs a CPU with amx_int8.

Weights are int4 groups of 32 with the two-level scales a Q4_K_M GGUF gives (codes times a float
factor per 256 inputs; ``woq_a8_ab.kquant_values``), shaped as Qwen2.5-1.5B's linears: [1536, 1536]
(q, o), [8960, 1536] (gate or up), [1536, 8960] (down). Before timing, the three kernels must agree
bit for bit on every shape and row count.

    python scripts/a8_prefill_rows.py --rev HEAD --rows 16,64,128,256 --threads 1,2

Prints a table: per (shape, threads, rows) the fastest call time of each kernel (ms) and the ratio
revision AMX / working-tree AMX (above 1: the working tree is faster).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402

from specdec.kernels.cpu import amx_cpu, woq_cpu  # noqa: E402
from specdec.kernels.cpu.woq_format import quantize_int4  # noqa: E402
from woq_a8_ab import kquant_values  # noqa: E402
from woq_a8_amx_ab import build_revision  # noqa: E402

SHAPES = ((1536, 1536), (8960, 1536), (1536, 8960))  # (N, K)


def q4k_weight(n: int, k: int, seed: int) -> tuple:
    """The kernel arguments of a random [n, k] weight as Q4_K: int4 groups of 32, two-level scales."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02
    q = quantize_int4(w, 32)
    q.scales = kquant_values(q.scales, 32, 63)
    q.offsets = kquant_values(q.offsets, 32, 63)
    return woq_cpu.a8_kernel_args(woq_cpu.A8Weight.prepare(q))


def fastest_ms(op, x: torch.Tensor, args: tuple, calls: int) -> float:
    op(x, *args, None)  # warm: caches, page faults, the thread pool
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        op(x, *args, None)
        times.append((time.perf_counter() - t) * 1e3)
    return min(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", default="HEAD", help="git revision whose AMX kernel is the baseline")
    ap.add_argument("--rows", default="16,64,128,256", help="activation rows per call (comma-separated)")
    ap.add_argument("--threads", default="1,2", help="thread counts (comma-separated)")
    ap.add_argument("--calls", type=int, default=7, help="timed calls per kernel and case (the fastest is reported)")
    args = ap.parse_args()
    ours = amx_cpu.extension_a8()
    if ours is None:
        raise SystemExit("no AMX int8 here, or the working tree's kernel did not build")
    kernels = {"rev amx": build_revision(args.rev), "tree amx": ours.a8_linear_amx.default,
               "vnni": ours.a8_linear.default}
    rows = [int(v) for v in args.rows.split(",")]
    print(f"rev {args.rev}; fastest of {args.calls} calls, ms; speedup = rev amx / tree amx\n")
    print("| shape [N x K] | threads | rows | " + " | ".join(kernels) + " | speedup |")
    print("|---|---|---|" + "---|" * len(kernels) + "---|")
    for i, (n, k) in enumerate(SHAPES):
        weight = q4k_weight(n, k, i)
        xs = {m: torch.randn(m, k, generator=torch.Generator().manual_seed(m)) for m in rows}
        for m, x in xs.items():
            outs = [op(x, *weight, None) for op in kernels.values()]
            if not all(torch.equal(outs[0], out) for out in outs[1:]):
                raise SystemExit(f"[{n} x {k}] M={m}: the kernels' results differ; not timed")
        for threads in (int(v) for v in args.threads.split(",")):
            torch.set_num_threads(threads)
            for m, x in xs.items():
                ms = {name: fastest_ms(op, x, weight, args.calls) for name, op in kernels.items()}
                print(f"| {n} x {k} | {threads} | {m} | " + " | ".join(f"{v:.2f}" for v in ms.values())
                      + f" | {ms['rev amx'] / ms['tree amx']:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
