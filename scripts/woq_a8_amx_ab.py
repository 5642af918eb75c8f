#!/usr/bin/env python
"""The AMX path of the int8-activation CPU kernel (``a8_linear_amx`` in
specdec/kernels/cpu/csrc/woq_a8.cpp) of the working tree against the one of a git revision, side by
side in one process, at prefill row counts. Needs a CPU with amx_int8.

The call sequence is a few layers' linears of a Qwen2.5-1.5B Q4_K_M model (q, k, v, o, gate_up,
down: int4 groups of 32, about half of v and down int8 groups of 16, two-level scales), as
``woq_a8_ab.py`` builds them. Both kernels get the same weights and activations and alternate
sequence by sequence; before timing, the working tree's AMX result must equal its VNNI result and
the revision's AMX result bit for bit.

    python scripts/woq_a8_amx_ab.py --rev HEAD --rows 16,32,64,110,128,256,512 --rounds 5

Prints, per row count, the median sequence time of each kernel (ms), prompt rows per second through
the sequence scaled to 28 layers, and the ratio of the medians (working tree / revision).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402

from specdec.kernels.cpu import amx_cpu, cpp_build, woq_cpu  # noqa: E402
from specdec.kernels.cpu.woq_format import quantize_int4, quantize_int8  # noqa: E402
from woq_a8_ab import CSRC, kquant_values  # noqa: E402

SHAPES = ((1536, 1536, True), (256, 1536, True), (256, 1536, None), (1536, 1536, True), (17920, 1536, True),
          (1536, 8960, None))  # (N, K, int4); None: int4 on even layers, int8 on odd ones (Q6_K)


def build_revision(rev: str):
    """``rev``'s a8_linear_amx, built from its own kernel sources (every file of its csrc folder, so the
    headers woq_a8.cpp includes come from the same commit) under another namespace."""
    sha = subprocess.run(["git", "rev-parse", rev], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()
    src = Path(tempfile.gettempdir()) / f"woq_a8_amx_rev_{sha[:12]}"  # one folder per commit: built once
    src.mkdir(exist_ok=True)
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{sha}:{CSRC}"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    for name in names:
        text = subprocess.run(["git", "show", f"{sha}:{CSRC}/{name}"], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout
        (src / name).write_text(text)
    ns = "specdec_woq_a8_amx_rev"
    ops = cpp_build.load_ops(ns, "woq_a8.cpp", ns, ["-O3", *amx_cpu.A8_FLAGS, f"-DSPECDEC_LIB={ns}"],
                             needs=amx_cpu.A8_NEEDS, what=f"{rev}'s AMX kernel", fallback="nothing to compare",
                             csrc=src)
    if ops is None:
        raise SystemExit(f"{rev}'s kernel did not build (see the warning above)")
    return ops.a8_linear_amx.default


def layer_weights(layers: int, seed: int = 0) -> list[tuple[tuple, int]]:
    """(kernel arguments, K) of each linear of ``layers`` layers, in order (the layout is the same for
    both revisions: only the tile code differs)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for layer in range(layers):
        for n, k, int4 in SHAPES:
            int4 = (layer % 2 == 0) if int4 is None else int4
            w = torch.randn(n, k, generator=gen) * 0.02
            q = quantize_int4(w, 32) if int4 else quantize_int8(w, 16)
            q.scales = kquant_values(q.scales, 32 if int4 else 16, 63 if int4 else 127)
            if int4:
                q.offsets = kquant_values(q.offsets, 32, 63)
            out.append((woq_cpu.a8_kernel_args(woq_cpu.A8Weight.prepare(q)), k))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", default="HEAD", help="git revision whose kernel is the baseline")
    ap.add_argument("--rows", default="16,32,64,128,256", help="activation rows per call (comma-separated)")
    ap.add_argument("--layers", type=int, default=2, help="layers of linears in the timed sequence")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--num-threads", type=int, default=2)
    args = ap.parse_args()
    ours = amx_cpu.extension_a8()
    if ours is None:
        raise SystemExit("no AMX int8 here, or the working tree's kernel did not build")
    kernels = {"rev": build_revision(args.rev), "tree": ours.a8_linear_amx.default}
    torch.set_num_threads(args.num_threads)
    weights = layer_weights(args.layers)
    print(f"{len(weights)} linears ({args.layers} layers), {args.num_threads} threads, rev {args.rev}")
    for m in (int(v) for v in args.rows.split(",")):
        gen = torch.Generator().manual_seed(m)
        xs = {k: torch.randn(m, k, generator=gen) for k in {k for _, k in weights}}
        for a, k in weights[:2 * len(SHAPES)]:
            tree = kernels["tree"](xs[k], *a, None)
            if not (torch.equal(tree, ours.a8_linear(xs[k], *a, None)) and torch.equal(tree, kernels["rev"](xs[k], *a, None))):
                raise SystemExit(f"M={m}: the AMX result differs from the VNNI or the revision's; not timed")
        times = {name: [] for name in kernels}
        for rnd in range(args.rounds + 1):  # the first round warms up, untimed
            for name, op in kernels.items():
                t = time.perf_counter()
                for a, k in weights:
                    op(xs[k], *a, None)
                if rnd:
                    times[name].append((time.perf_counter() - t) * 1e3)
        med = {name: statistics.median(v) for name, v in times.items()}
        per_28 = {name: 28 / args.layers * med[name] / 1e3 for name in kernels}
        print(f"M={m}: " + "  ".join(f"{name} {med[name]:.1f} ms ({m / per_28[name]:.0f} rows/s at 28 layers)"
                                     for name in kernels) + f"  tree/rev {med['tree'] / med['rev']:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
