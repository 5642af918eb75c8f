#!/usr/bin/env python
"""The int8-activation CPU kernel (specdec/kernels/cpu/csrc/woq_a8.cpp) of the working tree against the
one of a git revision, side by side in one process: the revision's woq_a8.cpp and csrc headers are
built under their own namespace, both kernels get the same weights, and they alternate call
sequence by call sequence, so the machine's memory-bandwidth phases hit both alike (separate
processes on a shared VM differ by more than most kernel changes).

The call sequence is one decode step's linears of a Qwen2.5-1.5B Q4_K_M model as specdec runs it
(28 layers of q/k/v, o, gate_up, down: int4 groups of 32, the Q6_K ones int8 groups of 16, and an
int8 LM head), with group scales in the two-level form GGUF K-quants take (codes times a factor
per super-block of 256 inputs). Each kernel gets the weights in its own layout, prepared by its
revision's ``woq_cpu.A8Weight``; the script checks the two compute the same function (to float32
rounding) before timing and stops otherwise.

    python scripts/woq_a8_ab.py --rev HEAD --rows 1,2,6,7 --rounds 9
    python scripts/woq_a8_ab.py --rev main --rows 1,2 --shapes 1536x1536,8960x1536,1536x8960 --num-threads 1

Prints, per row count, the median and the fastest sequence of each kernel (ms) and the ratio of
the medians (working tree / revision).
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from specdec.kernels.cpu import cpp_build, woq_cpu  # noqa: E402
from specdec.kernels.cpu.woq_format import quantize_int4, quantize_int8  # noqa: E402

CSRC = "specdec/kernels/cpu/csrc"


def build_revision(rev: str):
    """(a8_linear of ``rev``'s kernel, built from its own sources under namespace specdec_woq_a8_rev;
    ``rev``'s woq_cpu module, which prepares the weights in its layout)."""
    isa, flags, needs = woq_cpu.build_args(None, a8=True)
    src = Path(tempfile.mkdtemp(prefix="woq_a8_rev_"))
    headers = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{CSRC}"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.split()
    for path in (f"{CSRC}/woq_a8.cpp", *(f"{CSRC}/{h}" for h in headers if h.endswith(".h")),
                 "specdec/kernels/cpu/woq_cpu.py"):
        text = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout
        (src / Path(path).name).write_text(text)
    spec = importlib.util.spec_from_file_location("woq_cpu_rev", src / "woq_cpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    ns = "specdec_woq_a8_rev"
    ops = cpp_build.load_ops(ns, "woq_a8.cpp", ns, ["-O3", *flags, f"-DSPECDEC_LIB={ns}"], needs=needs,
                             what=f"{rev}'s kernel", fallback="nothing to compare", csrc=src)
    if ops is None:
        raise SystemExit(f"{rev}'s kernel did not build (see the warning above)")
    return ops.a8_linear.default, module


def kquant_values(values: torch.Tensor, group_size: int, top: int) -> torch.Tensor:
    """[N, K / G] group scales or offsets rounded to what a GGUF K-quant holds: integer codes in
    [-top, top] times one factor per super-block of 256 inputs (Q4_K: 6-bit codes, top 63; Q6_K:
    int8 codes, top 127), so the kernel reads them in its two-level form as it does a real file's."""
    per = woq_cpu.SUPER_BLOCK // group_size
    blocks = values.reshape(values.shape[0], -1, per)
    factor = blocks.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / top
    return ((blocks / factor).round() * factor).reshape(values.shape)


def make_weight(modules: dict, gen: torch.Generator, n: int, k: int, int4: bool) -> tuple[dict, int, int]:
    """({kernel: its arguments}, K, bytes) of a random [n, k] linear, int4 groups of 32 or int8 of 16."""
    w = torch.randn(n, k, generator=gen) * 0.02
    q = quantize_int4(w, 32) if int4 else quantize_int8(w, 16)
    q.scales = kquant_values(q.scales, 32 if int4 else 16, 63 if int4 else 127)
    if int4:
        q.offsets = kquant_values(q.offsets, 32, 63)
    args = {}
    for name, module in modules.items():
        a8 = module.A8Weight.prepare(q)
        assert a8.kernel_scales[1] is not None, "expected the two-level scale form"
        args[name] = module.a8_kernel_args(a8)
    return args, k, q.nbytes


def step_weights(modules: dict, seed: int = 0) -> list[tuple[dict, int, int]]:
    """({kernel: its arguments}, K, bytes) of each linear of one decode step, in order."""
    gen = torch.Generator().manual_seed(seed)

    def make(n: int, k: int, int4: bool):
        return make_weight(modules, gen, n, k, int4)

    out = []
    for layer in range(28):
        six = layer % 2 == 1  # Q4_K_M keeps about half of v and down in Q6_K
        out += [make(1536, 1536, True), make(256, 1536, True), make(256, 1536, not six), make(1536, 1536, True),
                make(17920, 1536, True), make(1536, 8960, not six)]
    out.append(make(151936, 1536, False))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", default="HEAD", help="git revision whose kernel is the baseline")
    ap.add_argument("--rows", default="1,2,6,7", help="activation rows per call (comma-separated)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--shapes", default="", help="NxK,... int4 linears timed shape by shape (a sequence of "
                                                  "distinct weights, about 64 MB) instead of the decode step")
    args = ap.parse_args()
    ours = woq_cpu.extension_a8()
    if ours is None:
        raise SystemExit("the working tree's kernel did not build (see the warning above)")
    rev_op, rev_module = build_revision(args.rev)
    kernels = {"rev": rev_op, "tree": ours.a8_linear.default}
    torch.set_num_threads(args.num_threads)
    modules = {"rev": rev_module, "tree": woq_cpu}
    if args.shapes:
        gen = torch.Generator().manual_seed(0)
        sequences = {}
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            # distinct weights, as a model's layers are: each call streams its weight from memory
            sequences[f"[{n}x{k}] int4"] = [make_weight(modules, gen, n, k, True)
                                            for _ in range(max(1, round(64e6 / (n * k / 2))))]
    else:
        sequences = {"decode step": step_weights(modules)}
    for label, weights in sequences.items():
        total_mb = sum(b for _, _, b in weights) / 1e6
        print(f"{label}: {len(weights)} linears, {total_mb:.0f} MB of weights, {args.num_threads} threads, "
              f"rev {args.rev}")
        compare(kernels, weights, args)
    return 0


def compare(kernels: dict, weights: list, args) -> None:
    for m in (int(v) for v in args.rows.split(",")):
        xs = {k: torch.randn(m, k) for k in {k for _, k, _ in weights}}
        for a, k, _ in weights[:6] + weights[-1:]:
            y = {name: op(xs[k], *a[name], None) for name, op in kernels.items()}
            if not torch.allclose(y["rev"], y["tree"], rtol=1e-4, atol=1e-4):
                raise SystemExit(f"M={m}: the kernels disagree; not timed")
        times = {name: [] for name in kernels}
        for rnd in range(args.rounds + 1):  # the first round warms up, untimed
            for name, op in kernels.items():
                t = time.perf_counter()
                for a, k, _ in weights:
                    op(xs[k], *a[name], None)
                if rnd:
                    times[name].append((time.perf_counter() - t) * 1e3)
        med = {name: statistics.median(v) for name, v in times.items()}
        print(f"M={m}: " + "  ".join(f"{name} {med[name]:.2f} ms (fastest {min(v):.2f})" for name, v in times.items())
              + f"  per call: " + "  ".join(f"{name} {med[name] / len(weights) * 1e3:.0f} us" for name in med)
              + f"  tree/rev {med['tree'] / med['rev']:.3f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
