"""The one-call CPU MoE kernel (``layers.moe_a8.A8FusedMoE``) against the same layers run expert by
expert (``SparseMoE``: a few ATen ops per touched expert), in one process on one loaded model:
batch-1 decode tokens/s alternated ``--rounds`` times, then v(K) = t(K+1 rows) / t(1 row) for
K = 1..``--max-k`` and the one-row forward time in each mode.

    PYTHONPATH=. python scripts/moe_cpu_kernel.py --output-json bench_results/moe_cpu_kernel.json

Default model: the 12-layer Qwen3-30B-A3B-shaped Q4_K_M GGUF that ``scripts/moe_gguf_peer.py build``
writes, with ``quantization="w4a8"`` (the only format the kernel takes: int8 activations).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from moe_gguf_peer import DEFAULT_DIR, specdec_decode_tps, verification_costs  # noqa: E402


def fused_layers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Module, torch.nn.Module]]:
    """(parent, attribute, fused layer, its expert-by-expert twin) of every ``A8FusedMoE``."""
    from specdec.layers.moe_a8 import A8FusedMoE

    return [(parent, name, child, child.unfused()) for parent in model.modules()
            for name, child in parent.named_children() if isinstance(child, A8FusedMoE)]


def use(layers, fused: bool) -> None:
    for parent, name, one_call, by_expert in layers:
        setattr(parent, name, one_call if fused else by_expert)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", default=str(DEFAULT_DIR / "moe-Q4_K_M.gguf"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-k", type=int, default=7)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    from specdec import LLM
    from specdec.bench.report import cpu_header

    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    llm = LLM(model=args.gguf, device="cpu", max_model_len=512, spec_cost_calibration=False, quantization="w4a8")
    layers = fused_layers(llm.engine.executor.driver_worker.runner.model)
    if not layers:
        sys.exit("no MoE layer runs the one-call kernel here (kernel unavailable, or not an int8-activation MoE)")
    modes = {"one_call": True, "by_expert": False}
    for fused in modes.values():  # warm-up: kernels built and chosen in both modes
        use(layers, fused)
        specdec_decode_tps(llm, 16)
    tps = {mode: [] for mode in modes}
    for r in range(args.rounds):
        for mode, fused in modes.items():
            use(layers, fused)
            tps[mode].append(specdec_decode_tps(llm, args.tokens))
        print(f"round {r}: one call {tps['one_call'][-1]:.2f} tok/s, by expert {tps['by_expert'][-1]:.2f} tok/s",
              flush=True)
    costs = {}
    for mode, fused in modes.items():
        use(layers, fused)
        costs[mode] = verification_costs(llm, args.max_k, args.context)
    use(layers, True)
    result = {
        "machine": cpu_header(argparse.Namespace(device="cpu")), "gguf": args.gguf, "threads": args.threads,
        "tokens": args.tokens, "moe_layers": len(layers), "tokens_per_s": tps,
        "one_call_over_by_expert": statistics.median(a / b for a, b in zip(tps["one_call"], tps["by_expert"])),
        "verification": costs, "load_average_at_end": os.getloadavg(),
    }
    print(json.dumps(result, indent=1, default=str))
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
