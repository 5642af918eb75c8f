"""auto K against fixed K on a target + draft-model pair, batch 1, one process with shared target
weights, engines rotated per round after an untimed warm-up round (the code prompts of
``specdec bench compare``, greedy, EOS ignored).

    python scripts/auto_vs_fixed_k.py                                  # Qwen2.5-Coder 1.5B + 0.5B, bf16
    python scripts/auto_vs_fixed_k.py --target ~/.cache/specdec/downloads/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \\
        --quantization w4a8 --draft-quantization w4a8 --ks 4 5 6 --max-k 8 --plain --output-json out.json
"""
import argparse
import gc
import json
import platform
import statistics
import sys
import time

from specdec import LLM, SamplingParams
from specdec.bench.driver import CODE_PROMPTS
from specdec.bench.roofline import measure_bandwidth
from specdec.worker.shared_weights import SharedWeights

parser = argparse.ArgumentParser()
parser.add_argument("--target", default="Qwen2.5-Coder-1.5B-Instruct")
parser.add_argument("--draft", default="Qwen2.5-Coder-0.5B-Instruct")
parser.add_argument("--quantization", default=None)
parser.add_argument("--draft-quantization", default=None)
parser.add_argument("--ks", type=int, nargs="+", default=[4, 5])
parser.add_argument("--max-k", type=int, default=5, help="auto's max_num_speculative_tokens")
parser.add_argument("--plain", action="store_true", help="also a no-speculation engine")
parser.add_argument("--draft-vocab-sizes", type=int, nargs="*", default=[],
                    help="also the first fixed K with the draft's LM head cut to each size (draft_vocab_size)")
parser.add_argument("--output-len", type=int, default=64)
parser.add_argument("--num-prompts", type=int, default=8)
parser.add_argument("--rounds", type=int, default=3)
parser.add_argument("--output-json", default=None)
args = parser.parse_args()

common = dict(num_threads=2, max_model_len=1024, kv_cache_memory=268435456, quantization=args.quantization)


def draft(k, **extra):
    return {"method": "draft_model", "model": args.draft, "num_speculative_tokens": k,
            "quantization": args.draft_quantization, **extra}


weights = SharedWeights()  # one copy of the target for every engine
first = LLM(model=args.target, target_weights=weights, **common, speculative_config=draft(args.ks[0]))
engines = {f"K={args.ks[0]}": first}
for k in args.ks[1:]:
    engines[f"K={k}"] = LLM(model=args.target, target_weights=weights, **common, speculative_config=draft(k))
engines["auto"] = LLM(model=args.target, target_weights=weights, **common,
                      speculative_config=draft("auto", max_num_speculative_tokens=args.max_k))
for n in args.draft_vocab_sizes:
    engines[f"K={args.ks[0]} vocab {n}"] = LLM(model=args.target, target_weights=weights, **common,
                                               speculative_config=draft(args.ks[0], draft_vocab_size=n))
if args.plain:
    engines["plain"] = LLM(model=args.target, target_weights=weights, **common)
tok = first.tokenizer
ids = [tok.encode(p) for p in CODE_PROMPTS[: args.num_prompts]]
params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
names = list(engines)
rates = {n: [] for n in names}
bandwidths = []
for r in range(-1, args.rounds):
    order = names[r % len(names):] + names[:r % len(names)]
    if r >= 0:
        bandwidths.append(measure_bandwidth(256 << 20) / 1e9)
    for n in order:
        gc.collect()
        t, toks = time.perf_counter(), 0
        for p in ids:
            toks += len(engines[n].generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids)
        if r >= 0:
            rates[n].append(toks / (time.perf_counter() - t))
    if r >= 0:
        print("round", r, "copy GB/s", round(bandwidths[-1], 1), {n: round(rates[n][-1], 2) for n in names}, flush=True)
fixed = [n for n in names if n.startswith("K=") and "vocab" not in n]
summary = {"kind": "auto_vs_fixed_k", "command": "python " + " ".join(sys.argv),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": {"cpu": platform.processor() or platform.machine(), "torch_threads": 2,
                       "bandwidth_gb_per_s": statistics.median(bandwidths)},
           "args": vars(args), "copy_gb_per_s": bandwidths, "engines": {}}
for n in names:
    m = engines[n].get_metrics()
    summary["engines"][n] = {"tokens_per_s_per_round": rates[n], "median": statistics.median(rates[n]),
                             "mean_acceptance_length": m.get("mean_acceptance_length"),
                             "k_histogram": m.get("k_histogram")}
    print(n, "median tok/s", round(statistics.median(rates[n]), 2), "per round", [round(x, 2) for x in rates[n]],
          "MAL", m.get("mean_acceptance_length") and round(m["mean_acceptance_length"], 2), "k_hist", m.get("k_histogram"))
ratios = [rates["auto"][i] / max(rates[n][i] for n in fixed) for i in range(args.rounds)]
summary["auto_over_best_fixed_per_round"] = ratios
summary["auto_over_best_fixed_median"] = statistics.median(ratios)
print("auto / best fixed per round", [round(x, 3) for x in ratios], "median", round(statistics.median(ratios), 3))
if args.output_json:
    with open(args.output_json, "w") as f:
        json.dump(summary, f, indent=1)
