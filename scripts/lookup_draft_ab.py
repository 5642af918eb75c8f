"""draft_model_lookup against plain draft_model on HumanEval completions: one process, one shared
copy of the target, the two engines alternated task by task (which one runs first flips every
task), greedy, the serve-peers stop strings; end-to-end seconds per task, their median ratio, and
a check that both engines emit the same tokens.

    python scripts/lookup_draft_ab.py --num-tasks 16 --output-json lookup_ab.json
    python scripts/lookup_draft_ab.py --prompt-lookup '{"source": "ngram", "min_match": 2, "min_tokens": 1}' --k 6

Lookup steps are read from the public step records: at batch 1 a step whose drafts came with no
draft-model pass was filled by the lookup; the next step's accepted count is that lookup's.
"""
import argparse
import json
import platform
import statistics
import sys
import time

from specdec import LLM, SamplingParams
from specdec.bench.serve_tasks import STOP, load_tasks
from specdec.spec_decode.suffix import SuffixProposer
from specdec.worker.shared_weights import SharedWeights
from lookup_acceptance import HOME, rule_table, step_rows  # noqa: E402 (this folder is on sys.path)

parser = argparse.ArgumentParser()
parser.add_argument("--target", default=f"{HOME}/downloads/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
parser.add_argument("--tokenizer", default=f"{HOME}/models/Qwen2.5-Coder-1.5B-Instruct")
parser.add_argument("--draft", default=f"{HOME}/models/Qwen2.5-Coder-0.5B-Instruct")
parser.add_argument("--k", default="6", help="num_speculative_tokens: an int or auto")
parser.add_argument("--prompt-lookup", default='{"source": "suffix", "min_tokens": 3}')
parser.add_argument("--confidence", type=float, default=0.0, help="draft_confidence_threshold (both engines)")
parser.add_argument("--num-tasks", type=int, default=16)
parser.add_argument("--max-tokens", type=int, default=256)
parser.add_argument("--num-threads", type=int, default=2)
parser.add_argument("--output-json", default=None)
args = parser.parse_args()

k = args.k if args.k == "auto" else int(args.k)
base = {"model": args.draft, "num_speculative_tokens": k, "quantization": "w4a8", "draft_vocab_size": 49152,
        "draft_confidence_threshold": args.confidence}
specs = {"draft_model": {"method": "draft_model", **base},
         "draft_model_lookup": {"method": "draft_model_lookup", **base, "prompt_lookup": json.loads(args.prompt_lookup)}}
weights = SharedWeights()
engines = {name: LLM(model=args.target, tokenizer=args.tokenizer, quantization="w4a8", num_threads=args.num_threads,
                     max_model_len=2048, kv_cache_memory=256 << 20, target_weights=weights, speculative_config=spec)
           for name, spec in specs.items()}
stats = {name: {"steps": 0, "lookup_steps": 0, "lookup_accepted": 0, "lookup_drafted": 0} for name in engines}


def observer(name):
    last = {"lookup": False}

    def observe(record):
        res, s = record.result, stats[name]
        if res.num_draft_tokens and res.num_draft_tokens[0]:
            s["steps"] += 1
            if last["lookup"]:
                s["lookup_steps"] += 1
                s["lookup_drafted"] += res.num_draft_tokens[0]
                s["lookup_accepted"] += res.num_accepted_tokens[0]
        last["lookup"] = bool(res.draft_token_ids and res.draft_token_ids[0]) and res.num_draft_passes == 0
    return observe


plain_records = []  # draft_model's steps of the task running: where would a lookup have fired?
for name, llm in engines.items():
    llm.engine.add_step_observer(observer(name))
engines["draft_model"].engine.add_step_observer(plain_records.append)
suffix = SuffixProposer(int(args.k) if args.k != "auto" else 8)
steps, costs = [], {}
params = SamplingParams(temperature=0, max_tokens=args.max_tokens, stop=STOP)
tasks = load_tasks("humaneval", args.num_tasks)
for llm in engines.values():  # warm-up: kernels, caches, the first shapes
    llm.generate([tasks[0].prompt], params, use_tqdm=False)
for s in stats.values():
    s.update(steps=0, lookup_steps=0, lookup_accepted=0, lookup_drafted=0)
names = list(engines)
rows = []
for i, task in enumerate(tasks):
    order = names if i % 2 == 0 else names[::-1]
    row = {"task": task.task_id}
    tokens = {}
    for name in order:
        plain_records.clear()
        t0 = time.perf_counter()
        out = engines[name].generate([task.prompt], params, use_tqdm=False)[0].outputs[0]
        row[name + "_s"] = time.perf_counter() - t0
        tokens[name] = list(out.token_ids)
        if name == "draft_model":
            prompt_ids = engines[name].tokenizer.encode(task.prompt)
            steps += step_rows(task.task_id, prompt_ids, tokens[name], plain_records, suffix, suffix.num_speculative_tokens,
                               costs)
    row["num_tokens"] = len(tokens[names[0]])
    row["identical"] = tokens[names[0]] == tokens[names[1]]
    row["speedup"] = row["draft_model_s"] / row["draft_model_lookup_s"]
    rows.append(row)
    print(f"{task.task_id}: {row['num_tokens']} tokens, draft_model {row['draft_model_s']:.2f} s, "
          f"lookup {row['draft_model_lookup_s']:.2f} s, x{row['speedup']:.3f}, identical {row['identical']}", flush=True)

summary = {"command": "python " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": platform.processor() or platform.machine(), "specs": specs, "tasks": rows,
           "median_speedup": statistics.median(r["speedup"] for r in rows),
           "total_speedup": sum(r["draft_model_s"] for r in rows) / sum(r["draft_model_lookup_s"] for r in rows),
           "all_identical": all(r["identical"] for r in rows), "engines": {}}
for name, llm in engines.items():
    m = llm.get_metrics()
    s = stats[name]
    summary["engines"][name] = {**s, "mean_acceptance_length": m.get("mean_acceptance_length"),
                                "seconds": sum(r[name + "_s"] for r in rows)}
    print(name, f"{summary['engines'][name]['seconds']:.1f} s total, MAL {m.get('mean_acceptance_length')}, "
          f"lookup steps {s['lookup_steps']}/{s['steps']}, lookup accepted {s['lookup_accepted']}/{s['lookup_drafted']}")
print(f"median per-task speedup {summary['median_speedup']:.3f}x, total {summary['total_speedup']:.3f}x, "
      f"tokens identical: {summary['all_identical']}")
summary["lookup_rules"] = rule_table(steps, costs, suffix.num_speculative_tokens) if steps else []
summary["steps"] = steps
if args.output_json:
    with open(args.output_json, "w") as f:
        json.dump(summary, f, indent=1)
