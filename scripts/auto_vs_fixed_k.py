"""auto K against fixed K=5 and K=4 on the Qwen2.5-Coder 1.5B + 0.5B pair, batch 1, one process with
shared target weights, configurations rotated per round after an untimed warm-up round.

    python scripts/auto_vs_fixed_k.py [OUTPUT_TOKENS]
"""
import gc, statistics, sys, time
from specdec import LLM, SamplingParams
from specdec.bench.driver import CODE_PROMPTS
from specdec.bench.roofline import measure_bandwidth
common = dict(num_threads=2, max_model_len=512, kv_cache_memory=268435456)
draft = "Qwen2.5-Coder-0.5B-Instruct"
target = LLM(model="Qwen2.5-Coder-1.5B-Instruct", **common,
             speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 5})
engines = {"K=5": target}
engines["K=4"] = LLM(model="Qwen2.5-Coder-1.5B-Instruct", share_weights_with=target, **common,
                     speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 4})
engines["auto"] = LLM(model="Qwen2.5-Coder-1.5B-Instruct", share_weights_with=target, **common,
                      speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": "auto",
                                          "max_num_speculative_tokens": 5})
tok = target.tokenizer
ids = [tok.encode(p) for p in CODE_PROMPTS]
params = SamplingParams(temperature=0, max_tokens=int(sys.argv[1]) if len(sys.argv) > 1 else 64, ignore_eos=True)
names = list(engines)
rates = {n: [] for n in names}
for r in range(-1, 3):
    order = names[r % 3:] + names[:r % 3]
    bw = measure_bandwidth(256 << 20) if r >= 0 else None
    for n in order:
        gc.collect(); t = time.perf_counter(); toks = 0
        for p in ids:
            toks += len(engines[n].generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids)
        el = time.perf_counter() - t
        if r >= 0:
            rates[n].append(toks / el)
    if r >= 0:
        print("round", r, "bandwidth GB/s", round(bw / 1e9, 1) if bw else None, {n: round(rates[n][-1], 2) for n in names}, flush=True)
for n in names:
    m = engines[n].get_metrics()
    print(n, "median tok/s", round(statistics.median(rates[n]), 2), "per round", [round(x, 2) for x in rates[n]],
          "MAL", round(m["mean_acceptance_length"], 2), "k_hist", m["k_histogram"])
print("auto / K=5 per round", [round(a / b, 3) for a, b in zip(rates["auto"], rates["K=5"])])
print("auto / best fixed per round", [round(a / max(b, c), 3) for a, b, c in zip(rates["auto"], rates["K=5"], rates["K=4"])])
