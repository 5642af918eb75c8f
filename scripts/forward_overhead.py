"""The fixed cost of one decode forward: ms/token of greedy batch-1 decoding of a model whose
weights are tiny, so what it measures is the per-forward overhead (module calls, op dispatch,
small kernels, the engine's step).

The model: a random 24-layer Qwen2 with hidden size 128 (``make_tiny_model``, the shape of a real
draft's layer stack without its bytes), built in a temporary folder. For each quantization
(``w4a8`` and none) it decodes 100 tokens after a 100-token prompt and prints ms/token as
(time of 100 tokens - time of 1 token) / 99: decoding alone, prefill excluded; median of
``--repeats`` runs after a warm-up, wall time and this process's CPU time (one thread: other
processes on shared cores barely move the latter). ``--model`` adds a real checkpoint (e.g. the
Qwen2.5-Coder-0.5B-Instruct draft at w4a8).

    PYTHONPATH=/path/to/checkout OMP_NUM_THREADS=1 python scripts/forward_overhead.py \
        [--model ~/.cache/specdec/models/Qwen2.5-Coder-0.5B-Instruct]

Two checkouts side by side (each in its own processes, alternating rounds):

    OMP_NUM_THREADS=1 python scripts/forward_overhead.py --compare base=/work/main,new=. --rounds 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tree_runs import run_trees

PROMPT_LEN, NEW_TOKENS = 100, 100


def build_tiny(root: Path) -> str:
    from specdec.models.tiny import make_tiny_model

    return str(make_tiny_model(root / "qwen2-24x128", arch="qwen2", vocab_size=1024, hidden_size=128, num_layers=24,
                               num_heads=2, num_kv_heads=1, intermediate_size=256))


def ms_per_token(model: str, quantization: str | None, repeats: int) -> dict[str, float]:
    from specdec import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", device="cpu", quantization=quantization, seed=0, max_model_len=512,
              max_num_seqs=1)
    prompt = {"prompt_token_ids": [3 + (7 * i) % 300 for i in range(PROMPT_LEN)]}  # ids every vocabulary has

    def timed(max_tokens: int) -> tuple[float, float]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        wall, cpu = time.perf_counter(), time.process_time()
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - wall, time.process_time() - cpu

    timed(NEW_TOKENS)  # warm-up: kernels loaded, kernel choices timed
    walls, cpus = [], []
    for _ in range(repeats):
        full, one = timed(NEW_TOKENS), timed(1)
        walls.append((full[0] - one[0]) / (NEW_TOKENS - 1))
        cpus.append((full[1] - one[1]) / (NEW_TOKENS - 1))
    return {"wall_ms": 1e3 * statistics.median(walls), "cpu_ms": 1e3 * statistics.median(cpus)}


def run(args) -> list[dict]:
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = [("tiny-qwen2-24x128", build_tiny(Path(tmp)))]
        if args.model:
            models.append((Path(args.model).name, str(Path(args.model).expanduser())))
        for name, path in models:
            for quant in args.quantizations.split(","):
                q = None if quant == "none" else quant
                row = {"model": name, "quantization": quant, **ms_per_token(path, q, args.repeats)}
                rows.append(row)
                print(f"{name:28s} {quant:6s} {row['wall_ms']:7.3f} ms/token wall  {row['cpu_ms']:7.3f} ms/token cpu",
                      flush=True)
    return rows


def compare(args) -> None:
    argv = ["--quantizations", args.quantizations, "--repeats", str(args.repeats)] + (
        ["--model", args.model] if args.model else [])
    runs = run_trees(args.compare, args.rounds, __file__, argv, "forward_overhead")
    names = list(runs)
    for r, first in enumerate(runs[names[0]][0]):
        cells = []
        for name in names:
            for col in ("wall_ms", "cpu_ms"):
                cells.append(f"{name} {col} {statistics.median(run[r][col] for run in runs[name]):7.3f}")
        ratio = ""
        if len(names) == 2:
            a, b = (statistics.median(run[r]["cpu_ms"] for run in runs[n]) for n in names)
            ratio = f"  {names[1]}/{names[0]} cpu {b / a:.3f}"
        print(f"{first['model']:28s} {first['quantization']:6s} " + "  ".join(cells) + ratio, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="also measure this checkpoint (a folder)")
    parser.add_argument("--quantizations", default="w4a8,none", help="comma-separated; 'none' for float32 weights")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="write the rows as JSON")
    parser.add_argument("--compare", help="name=checkout,name=checkout: run each in turn, --rounds times")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.compare:
        compare(args)
        return
    rows = run(args)
    if args.out:
        Path(args.out).write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
