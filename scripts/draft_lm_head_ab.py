#!/usr/bin/env python
"""A draft's LM head at int8 against int4 (``speculative_config.draft_lm_head_quantization``), side by
side in one process: two engines share the target's weights (``SharedWeights``) and differ only in
their draft's head; they alternate task by task (which one goes first alternates too), so a loaded
machine's phases hit both alike.

Per task (HumanEval prompts, completions cut at HumanEval's stop sequences, greedy) each engine's
seconds, tokens, drafts and accepted drafts (the engine's spec-decode metrics, as ``specdec bench``
reads them) and the draft's seconds per batch-1 pass of its decode steps (the step records' draft
time over their draft passes; prompt steps excluded). Both engines verify with the same target, so
their outputs must be identical token for token: the script stops otherwise. Then the two heads
alone, one row at a time, alternating (fastest of ``--head-calls`` calls each).

    python scripts/draft_lm_head_ab.py --num-tasks 16 --max-tokens 256 --num-threads 2

Prints per format: the median task seconds, median tok/s, the mean acceptance length (pooled over
the tasks, and the median of the per-task values), the median draft ms per pass, and the ratio
int4 / int8 of the task seconds (median of the per-task ratios).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from specdec import LLM, SamplingParams  # noqa: E402
from specdec.bench.serve_tasks import STOP, load_tasks  # noqa: E402
from specdec.engine.step_timings import StepTimings  # noqa: E402
from specdec.worker.shared_weights import SharedWeights  # noqa: E402

FORMATS = ("int8", "int4")
TARGET = "~/.cache/specdec/downloads/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"


class DraftPasses:
    """A step observer: the draft's seconds and passes over decode steps (no prompt rows)."""

    def __init__(self):
        self.seconds, self.passes = 0.0, 0

    def __call__(self, record) -> None:
        result = record.result
        if StepTimings.phase_of(record) == "decode" and result.num_draft_passes:
            self.seconds += result.draft_seconds
            self.passes += result.num_draft_passes


def make_engine(args, fmt: str, weights: SharedWeights) -> LLM:
    spec = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k, "quantization": "w4a8",
            "draft_vocab_size": args.draft_vocab_size, "draft_lm_head_quantization": fmt}
    return LLM(model=str(Path(args.target).expanduser()), target_weights=weights, quantization="w4a8",
               speculative_config=spec, num_threads=args.num_threads, max_model_len=args.max_model_len,
               max_num_seqs=1)


def run_task(llm: LLM, passes: DraftPasses, prompt: str, params: SamplingParams) -> dict:
    before = dict(llm.get_metrics())
    seconds0, passes0 = passes.seconds, passes.passes
    t = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    elapsed = time.perf_counter() - t
    after = llm.get_metrics()
    drafts = after["num_drafts"] - before.get("num_drafts", 0)
    accepted = after["num_accepted_tokens"] - before.get("num_accepted_tokens", 0)
    num_passes = passes.passes - passes0
    return {"seconds": elapsed, "tokens": len(out.token_ids), "token_ids": list(out.token_ids),
            "num_drafts": drafts, "num_accepted_tokens": accepted,
            "mal": 1 + accepted / drafts if drafts else None,
            "draft_ms_per_pass": 1e3 * (passes.seconds - seconds0) / num_passes if num_passes else None}


def time_heads(llms: dict[str, LLM], calls: int) -> dict[str, float]:
    """Fastest ms of one-row calls of each draft's LM head, the heads alternating call by call."""
    heads = {fmt: llm.engine.executor.driver_worker.draft_runner.model.lm_head for fmt, llm in llms.items()}
    x = torch.randn(1, next(iter(heads.values())).in_features)
    best = dict.fromkeys(heads, float("inf"))
    with torch.inference_mode():
        for head in heads.values():
            head(x)
        for _ in range(calls):
            for fmt, head in heads.items():
                t = time.perf_counter()
                head(x)
                best[fmt] = min(best[fmt], 1e3 * (time.perf_counter() - t))
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=TARGET)
    ap.add_argument("--draft", default="Qwen2.5-Coder-0.5B-Instruct")
    ap.add_argument("--tasks-file", default="humaneval")
    ap.add_argument("--num-tasks", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--k", type=int, default=6, help="num_speculative_tokens")
    ap.add_argument("--draft-vocab-size", type=int, default=49152)
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--head-calls", type=int, default=200)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.num_threads)
    weights = SharedWeights()
    llms, observers = {}, {}
    for fmt in FORMATS:
        llms[fmt] = make_engine(args, fmt, weights)
        observers[fmt] = DraftPasses()
        llms[fmt].engine.add_step_observer(observers[fmt])
        head = llms[fmt].engine.executor.driver_worker.draft_runner.model.lm_head
        print(f"{fmt}: draft LM head {head}", flush=True)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, stop=STOP)
    tasks = load_tasks(args.tasks_file, args.num_tasks)
    for llm in llms.values():  # warm-up: first-call costs, kernel plans
        llm.generate([tasks[0].prompt], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    rows = []
    for i, task in enumerate(tasks):
        order = FORMATS if i % 2 == 0 else FORMATS[::-1]
        row = {fmt: run_task(llms[fmt], observers[fmt], task.prompt, params) for fmt in order}
        if row["int8"]["token_ids"] != row["int4"]["token_ids"]:
            raise SystemExit(f"task {task.task_id}: the two engines' outputs differ; both verify with one target")
        rows.append(row)
        print(f"{task.task_id}: " + ", ".join(
            f"{fmt} {row[fmt]['seconds']:.2f}s MAL {row[fmt]['mal'] or 0:.2f} "
            f"draft {row[fmt]['draft_ms_per_pass'] or 0:.2f} ms/pass" for fmt in FORMATS)
            + f", {row['int8']['tokens']} tokens", flush=True)
    heads_ms = time_heads(llms, args.head_calls)
    summary = {}
    for fmt in FORMATS:
        runs = [r[fmt] for r in rows]
        drafts, accepted = sum(r["num_drafts"] for r in runs), sum(r["num_accepted_tokens"] for r in runs)
        summary[fmt] = {
            "median_task_seconds": statistics.median(r["seconds"] for r in runs),
            "median_tok_per_s": statistics.median(r["tokens"] / r["seconds"] for r in runs),
            "mal_pooled": 1 + accepted / drafts if drafts else None,
            "mal_median": statistics.median(r["mal"] for r in runs if r["mal"] is not None),
            "median_draft_ms_per_pass": statistics.median(r["draft_ms_per_pass"] for r in runs
                                                          if r["draft_ms_per_pass"] is not None),
            "lm_head_ms_1row": heads_ms[fmt]}
    ratio = statistics.median(r["int4"]["seconds"] / r["int8"]["seconds"] for r in rows)
    print("\n| draft LM head | median task s | median tok/s | MAL pooled | MAL median | draft ms/pass | head ms (1 row) |")
    print("|---|---|---|---|---|---|---|")
    for fmt, s in summary.items():
        print(f"| {fmt} | {s['median_task_seconds']:.2f} | {s['median_tok_per_s']:.2f} | {s['mal_pooled']:.3f} | "
              f"{s['mal_median']:.3f} | {s['median_draft_ms_per_pass']:.2f} | {s['lm_head_ms_1row']:.3f} |")
    print(f"\nint4 / int8 task seconds (median of per-task ratios): {ratio:.3f}; "
          f"MAL int4 / int8 (pooled): {summary['int4']['mal_pooled'] / summary['int8']['mal_pooled']:.4f}")
    if args.output_json:
        for r in rows:
            for fmt in FORMATS:
                r[fmt].pop("token_ids")
        Path(args.output_json).write_text(json.dumps({"args": vars(args), "summary": summary,
                                                      "int4_over_int8_seconds": ratio, "tasks": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
