#!/usr/bin/env python
"""The int8-activation kernel's variants on a draft's prompt-pass shapes, side by side: for each
weight shape and row count, every variant that runs here (``woq_a8_variants``, AMX included) and the
load-time choice (``cpu_kernel_choice.a8_row_ops``), alternating call by call over copies of the
weight (``cpu_kernel_choice.time_row_kernels``: the fastest call kept, which a loaded machine can
only slow down). Checks first that every variant gives the same values bit for bit.

    python scripts/a8_draft_shapes.py --shapes 1152x896,896x896,9728x896,896x4864 --rows 16,32,64,107,128

Default shapes: Qwen2.5-Coder-0.5B's linears (fused q/k/v, o, gate_up, down), int4 group 128.
Prints per shape and row count each variant's ms and the load-time choice's ms over the fastest's.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from specdec.kernels.cpu import woq_a8_variants, woq_cpu  # noqa: E402
from specdec.kernels.cpu.woq_format import quantize_int4  # noqa: E402
from specdec.layers import cpu_kernel_choice  # noqa: E402

CHOICE = "load-time choice"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1152x896,896x896,9728x896,896x4864", help="NxK,...")
    ap.add_argument("--rows", default="16,32,64,107,128")
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--copies", type=int, default=8, help="weight copies the calls walk")
    args = ap.parse_args()
    torch.set_num_threads(args.num_threads)
    rows = tuple(int(r) for r in args.rows.split(","))
    ops = woq_a8_variants.variant_ops(True)
    by_rows = cpu_kernel_choice.a8_row_ops(True)
    print(f"load-time plan (w4a8): {cpu_kernel_choice.describe_plan(cpu_kernel_choice.a8_variant_plan(True))}")
    print(f"{args.num_threads} thread(s); fastest call of {args.passes} passes x 8, ms\n")
    print("| N x K | rows | " + " | ".join(list(ops) + [CHOICE]) + " | choice / fastest |")
    print("|---|---|" + "---|" * (len(ops) + 2))
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.02
        one = woq_cpu.a8_kernel_args(woq_cpu.A8Weight.prepare(quantize_int4(w, 128)))
        copies = [tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in one) for _ in range(args.copies)]
        for m in rows:
            x = torch.randn(m, k)
            outs = {name: op(x, *one, None) for name, op in ops.items()}
            ref = outs[woq_a8_variants.default_variant()]
            if not all(torch.equal(ref, o) for o in outs.values()):
                raise SystemExit(f"{shape} M={m}: the variants' results differ; not timed")
        calls = {name: (lambda i, x, op=op: op(x, *copies[i], None)) for name, op in ops.items()}
        calls[CHOICE] = lambda i, x: by_rows[min(x.shape[0], len(by_rows) - 1)](x, *copies[i], None)
        times = cpu_kernel_choice.time_row_kernels(calls, k, rows, passes=args.passes, copies=args.copies,
                                                   dtype=torch.float32)
        for m in rows:
            fastest = min(times[name][m] for name in ops)
            cells = " | ".join(f"{1e3 * times[name][m]:.3f}" for name in calls)
            print(f"| {shape} | {m} | {cells} | {times[CHOICE][m] / fastest:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
