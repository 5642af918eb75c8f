"""The default pair on open-ended chat at a batch: plain vs the default (K "auto" with token
trees) vs "auto" with chains, alternated in one process; medians of per-repetition speedups.
Shows whether "auto" holds back where verification rows cost more than they return.
Run: python scripts/default_pair_batch.py [--batch 32] [--max-tokens 128] [--repeats 3]
"""
import argparse
import statistics

import torch

from specdec import LLM, SamplingParams
from specdec.bench.workloads import open_prompts, run_config
from specdec.models.default import DEFAULT_TARGET, default_engine_kwargs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tree_cfg = default_engine_kwargs()[1]["speculative_config"]
    chain_cfg = {k: v for k, v in tree_cfg.items() if k not in ("tree_topk", "tree_nodes")}
    engines = {"plain": LLM(model=DEFAULT_TARGET, max_model_len=1024),
               "auto-tree (default)": LLM(model=DEFAULT_TARGET, max_model_len=1024, speculative_config=tree_cfg),
               "auto-chain": LLM(model=DEFAULT_TARGET, max_model_len=1024, speculative_config=chain_cfg)}
    ids = [engines["plain"].apply_chat_template(m) for m in open_prompts(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for llm in engines.values():
        run_config(llm, ids, params)  # warm-up
    rates, mal = {name: [] for name in engines}, {}
    for _ in range(args.repeats):
        for name, llm in engines.items():
            elapsed, tokens, extra = run_config(llm, ids, params)
            rates[name].append(tokens / elapsed)
            mal[name] = extra["mean_acceptance_length"]
    for name in engines:
        ratios = [r / p for r, p in zip(rates[name], rates["plain"])]
        print(f"{name}: {statistics.median(rates[name]):.1f} tok/s, {statistics.median(ratios):.3f}x plain "
              f"({' '.join(f'{x:.3f}' for x in ratios)}), mean acceptance length "
              f"{'- (drafted nothing)' if mal[name] is None else f'{mal[name]:.2f}'}")


if __name__ == "__main__":
    main()
