"""Per-step engine overhead outside the forward passes, on tiny models (the forward costs little).

For plain decoding and the draft_model / eagle / ngram proposers at batch 1 and 32, greedy,
this runs ``LLM.generate`` (after a warm-up) and reads every decode step's ``StepRecord``: the
whole step, the target forward (with its input preparation), the proposal (draft forwards
included) and the verification, as means over the steps (the slowest tenth dropped).
``outside`` = step - target - draft: planning, scheduling, verification, commit, bookkeeping.

The ``*_cpu_us`` columns are CPU time of this process (``time.process_time``, one thread), which
other processes on shared cores barely move: ``forward_cpu_us`` is the model runners' forward
passes (target and draft / head, input preparation excluded), ``outside_cpu_us`` = step -
forward, everything else the engine does per step, the proposer's own bookkeeping included.

Run it on one checkout (PYTHONPATH selects the tree):

    PYTHONPATH=/path/to/checkout OMP_NUM_THREADS=1 python scripts/step_overhead.py --out a.json

or compare checkouts, each run in its own process, alternating, and print the medians (and the
range) of the per-run means:

    OMP_NUM_THREADS=1 python scripts/step_overhead.py --compare base=/tmp/base,new=. --rounds 5
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

PROMPTS = ["def f(x):", "import json", "class Decoder(object):", "    return value", "for i in range(10):",
           "if not isinstance(obj, dict):", "Hello", "x = [1, 2, 3]", "while True:\n    pass", "raise ValueError(msg)",
           "try:\n    import json\nexcept ImportError:", "lines = text.splitlines()", "print('hello world')",
           "return self.encode(o)", "chunks = self._split(text)", "s = json.dumps(obj, indent=4)"]


def build(root: Path) -> dict[str, str]:
    from specdec.models.eagle import init_head, save_head
    from specdec.models.loader import load_model
    from specdec.models.tiny import make_tiny_model, make_tokenizer

    tok = make_tokenizer()
    target = make_tiny_model(root / "target", arch="llama", tokenizer=tok)
    draft = make_tiny_model(root / "draft", arch="llama", num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1,
                            intermediate_size=64, seed=7, tokenizer=tok)
    head = init_head(load_model(str(target), torch.float32, torch.device("cpu")), seed=1)
    save_head(head, root / "head")
    return {"target": str(target), "draft": str(draft), "head": str(root / "head")}


def measure(paths: dict[str, str], method: str, batch: int, max_tokens: int) -> dict[str, float]:
    from specdec import LLM, SamplingParams

    spec = {"none": None,
            "draft_model": {"method": "draft_model", "model": paths["draft"], "num_speculative_tokens": 3},
            "eagle": {"method": "eagle", "model": paths["head"], "num_speculative_tokens": 3},
            "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                      "prompt_lookup_min": 1}}[method]
    # the torch attention path: no C++ extension to build, and the comparison is about what runs outside it
    llm = LLM(model=paths["target"], dtype="float32", device="cpu", seed=0, max_model_len=512, max_num_seqs=batch,
              attention_backend="torch", speculative_config=spec)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    records = []
    cpu = _time_cpu(llm.engine)  # record index -> (step CPU seconds, forward CPU seconds)
    llm.engine.add_step_observer(records.append)
    llm.generate(prompts, params, use_tqdm=False)
    steps = [(r, *cpu[i]) for i, r in enumerate(records)
             if all(n == 1 for n in r.scheduled.num_scheduled_tokens)]  # no prefill chunks
    # the slowest tenth of the steps dropped (shared cores: other processes' bursts), the same steps
    # for every column, so the means add up: step = target + draft + outside
    kept = sorted(steps, key=lambda s: s[0].step_seconds)[:max(1, len(steps) * 9 // 10)]
    cpu_kept = [(c, f) for _, c, f in kept]
    kept = [r for r, _, _ in kept]

    def mean_us(values):
        return 1e6 * statistics.fmean(values)

    return {
        "steps": len(kept),
        "tokens_per_step": sum(r.total_emitted_tokens for r in kept) / len(kept),
        "step_us": mean_us([r.step_seconds for r in kept]),
        "target_us": mean_us([r.result.target_seconds for r in kept]),
        "draft_us": mean_us([r.result.draft_seconds for r in kept]),
        "verify_us": mean_us([r.result.sampling_seconds for r in kept]),
        "outside_us": mean_us([r.step_seconds - r.result.target_seconds - r.result.draft_seconds for r in kept]),
        "step_cpu_us": mean_us([c for c, _ in cpu_kept]),
        "forward_cpu_us": mean_us([f for _, f in cpu_kept]),
        "outside_cpu_us": mean_us([c - f for c, f in cpu_kept]),
    }


def _time_cpu(engine) -> list[tuple[float, float]]:
    """Wrap ``engine.step`` and the forward of the target's and the proposer's model runners
    (instance attributes of this engine only) to take the CPU time of each step and of its
    forwards; returns the list the steps that leave a record append to."""
    worker = engine.executor.driver_worker
    runners = [worker.runner]
    draft = getattr(getattr(worker, "proposer", None), "runner", None)
    if draft is not None and draft is not worker.runner:
        runners.append(draft)
    clock = {"forward": 0.0, "depth": 0}
    for runner in runners:
        def timed(*args, _forward=runner.forward_with_hidden, **kwargs):
            clock["depth"] += 1
            t = time.process_time()
            try:
                return _forward(*args, **kwargs)
            finally:
                clock["depth"] -= 1
                if not clock["depth"]:
                    clock["forward"] += time.process_time() - t
        runner.forward_with_hidden = timed
    out: list[tuple[float, float]] = []
    stepped: list = []  # one entry per step that left a record
    engine.add_step_observer(stepped.append)
    step = engine.step

    def timed_step():
        clock["forward"] = 0.0
        num_stepped = len(stepped)
        t = time.process_time()
        outputs = step()
        if len(stepped) > num_stepped:
            out.append((time.process_time() - t, clock["forward"]))
        return outputs

    engine.step = timed_step
    return out


def run(args) -> list[dict]:
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = build(Path(tmp))
        for method in args.methods.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                row = {"method": method, "batch": batch, **measure(paths, method, batch, args.max_tokens)}
                rows.append(row)
                print(f"{method:12s} batch {batch:3d}: " + "  ".join(
                    f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
                    if k not in ("method", "batch")), flush=True)
    return rows


def compare(args) -> list[dict]:
    """Run this script on each tree in turn, ``rounds`` times (each in a fresh process, the trees
    alternating so a change in the machine's load falls on both), and summarise per method and
    batch: the median of the per-run means, and their range."""
    runs = run_trees(args.compare, args.rounds, __file__, ["--methods", args.methods, "--batches", args.batches,
                                                            "--max-tokens", str(args.max_tokens)], "step_overhead")
    trees = list(runs)
    summary = []
    columns = ("outside_cpu_us", "step_cpu_us", "forward_cpu_us", "outside_us", "tokens_per_step")
    for r, first in enumerate(runs[next(iter(trees))][0]):
        row = {"method": first["method"], "batch": first["batch"]}
        for name in trees:
            for col in columns:
                values = [run[r][col] for run in runs[name]]
                row[f"{name}_{col}"] = statistics.median(values)
                row[f"{name}_{col}_range"] = [min(values), max(values)]
        summary.append(row)
    names = list(trees)
    print(f"{'method':12s} {'batch':>5s}  " + "  ".join(f"{n + ' outside cpu':>22s}" for n in names)
          + "  " + "  ".join(f"{n + ' outside wall':>14s}" for n in names))
    for row in summary:
        cells = [f"{row[f'{n}_outside_cpu_us']:8.1f} [{row[f'{n}_outside_cpu_us_range'][0]:.0f}-"
                 f"{row[f'{n}_outside_cpu_us_range'][1]:.0f}]" for n in names]
        walls = [f"{row[f'{n}_outside_us']:14.1f}" for n in names]
        ratio = ""
        if len(names) == 2:
            ratio = f"  {names[1]}/{names[0]} cpu {row[f'{names[1]}_outside_cpu_us'] / row[f'{names[0]}_outside_cpu_us']:.3f}"
        print(f"{row['method']:12s} {row['batch']:5d}  " + "  ".join(f"{c:>22s}" for c in cells) + "  "
              + "  ".join(walls) + ratio, flush=True)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="none,draft_model,eagle,ngram")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--compare", help="name=path,name=path: run on each checkout in turn and summarise")
    parser.add_argument("--rounds", type=int, default=5, help="with --compare: runs per checkout")
    parser.add_argument("--out", help="write the rows (with --compare: the summary) as JSON here")
    args = parser.parse_args()
    rows = compare(args) if args.compare else run(args)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
