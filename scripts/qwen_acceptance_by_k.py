"""Acceptance of the Qwen2.5-Coder 0.5B draft against the 1.5B target, K = 1..8, greedy code prompts.

Acceptance does not depend on timing, so this can run beside other work (e.g. --threads 1).
Run: python scripts/qwen_acceptance_by_k.py [--threads N] [--out FILE]
"""
import argparse
import json

import torch

from specdec import LLM, SamplingParams
from specdec.bench.driver import CODE_PROMPTS

PROMPTS = CODE_PROMPTS[:6]  # the bench's code-completion prompts (this script's original six)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="bench_results/qwen_acceptance_by_k.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {}
    for k in range(1, 9):
        llm = LLM(model="Qwen2.5-Coder-1.5B-Instruct", max_model_len=1024, speculative_config={
            "method": "draft_model", "model": "Qwen2.5-Coder-0.5B-Instruct", "num_speculative_tokens": k})
        llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True), use_tqdm=False)
        m = llm.get_metrics()
        results[k] = {key: m[key] for key in ("acceptance_rate", "mean_acceptance_length", "acceptance_per_position",
                                               "num_drafts", "num_draft_tokens", "num_accepted_tokens")}
        print(k, round(m["acceptance_rate"], 3), round(m["mean_acceptance_length"], 2), flush=True)
        del llm
    with open(args.out, "w") as f:
        json.dump({"prompts": PROMPTS, "max_tokens": args.max_tokens, "dtype": "bfloat16", "by_k": results}, f, indent=2)


if __name__ == "__main__":
    main()
