"""Acceptance and speedup of the embedded default pair on held-out chat prompts (greedy, K=5).

The prompts are not in the distillation corpus (docs/DRAFT.md lists what is). Plain and
speculative engines are timed alternately in one process; medians over --repeats. The
acceptance at K=5 is also measured on the 48 held-out prompts of ``train-draft``'s own
evaluation (24 chat + 24 code, subjects not in its corpus; ~4,600 drafted-over tokens, 8x the
timed set), generated as one batch: acceptance does not depend on timing. Both figures are
given for a K=5 chain and for a depth-5 token tree (--tree-topk, --tree-nodes: the candidates
kept per node and the nodes verified).
Run: python scripts/default_pair_eval.py [--threads N] [--repeats R] [--out FILE]
"""
import argparse
import json
import statistics
import time

import torch

from specdec import LLM, SamplingParams
from specdec.models.default import (
    DEFAULT_TARGET,
    default_engine_kwargs,
    draft_spec_config,
)
from specdec.training.draft_corpus import HELDOUT_CHAT, HELDOUT_CODE

HELD_OUT = [
    "Write a Python function that merges two sorted lists.",
    "Explain the difference between a process and a thread.",
    "Give me three tips for writing clear commit messages.",
    "Write a haiku about autumn rain.",
    "How do I reverse a string in JavaScript?",
    "What is the capital of Australia, and why is it not Sydney?",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", default="bench_results/default_pair_eval.json")
    ap.add_argument("--draft", default=None, help="another draft folder to evaluate instead of the shipped one")
    ap.add_argument("--tree-topk", type=int, default=6)
    ap.add_argument("--tree-nodes", type=int, default=24)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    _, spec_kwargs = default_engine_kwargs()
    if args.draft:  # an EAGLE head or a Llama draft
        spec_kwargs["speculative_config"] = draft_spec_config(args.draft)
    plain = LLM(model=DEFAULT_TARGET, max_model_len=1024)
    spec = LLM(model=DEFAULT_TARGET, max_model_len=1024, **spec_kwargs)
    # acceptance at a fixed K=5 chain (auto drafts only where it pays)
    chain = {k: v for k, v in spec_kwargs["speculative_config"].items()
             if k not in ("max_num_speculative_tokens", "tree_topk", "tree_nodes")} | {"num_speculative_tokens": 5}
    tree = chain | {"tree_topk": args.tree_topk, "tree_nodes": args.tree_nodes}
    fixed = {"spec_k5": chain, "spec_k5_tree": tree}
    engines = {"plain": plain, "spec": spec} | {
        name: LLM(model=DEFAULT_TARGET, max_model_len=1024, speculative_config=cfg) for name, cfg in fixed.items()}
    prompts = [plain.apply_chat_template([{"role": "user", "content": p}]) for p in HELD_OUT]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rates = {name: [] for name in engines}
    outs = {}
    for _ in range(args.repeats):
        for name, llm in engines.items():
            t = time.perf_counter()
            res = [
                llm.generate([p], params, use_tqdm=False)[0] for p in prompts]  # batch 1, like a chat user
            rates[name].append(sum(len(r.outputs[0].token_ids) for r in res) / (time.perf_counter() - t))
            outs[name] = [r.outputs[0].token_ids for r in res]
    m = spec.get_metrics()
    agree = sum(a == b for a, b in zip(outs["plain"], outs["spec"]))
    result = {
        "target": DEFAULT_TARGET, "draft": spec_kwargs["speculative_config"], "prompts": HELD_OUT,
        "max_tokens": args.max_tokens, "repeats": args.repeats, "threads": torch.get_num_threads(),
        "plain_tokens_per_s": statistics.median(rates["plain"]), "spec_tokens_per_s": statistics.median(rates["spec"]),
        "speedup": statistics.median(s / p for s, p in zip(rates["spec"], rates["plain"])),
        "acceptance_rate": m["acceptance_rate"], "mean_acceptance_length": m["mean_acceptance_length"],
        "acceptance_per_position": m["acceptance_per_position"], "identical_outputs": f"{agree}/{len(prompts)}",
        "draft_tokens_per_draft": m["num_draft_tokens"] / m["num_drafts"] if m["num_drafts"] else 0.0,
    }
    wide_prompts = [plain.apply_chat_template([{"role": "user", "content": p}]) for p in HELDOUT_CHAT + HELDOUT_CODE]
    for name, cfg in fixed.items():
        mk = engines[name].get_metrics()
        wide = LLM(model=DEFAULT_TARGET, max_model_len=1024, speculative_config=cfg)
        wide.generate(wide_prompts, params, use_tqdm=False)
        m48 = wide.get_metrics()
        key = {"spec_k5": "k5", "spec_k5_tree": "k5_tree"}[name]
        result[key] = {"config": {k: v for k, v in cfg.items() if k != "model"},
                       "tokens_per_s": statistics.median(rates[name]),
                       "speedup": statistics.median(s / p for s, p in zip(rates[name], rates["plain"])),
                       "acceptance_rate": mk["acceptance_rate"], "mean_acceptance_length": mk["mean_acceptance_length"],
                       "acceptance_per_position": mk["acceptance_per_position"]}
        result[key + "_heldout48"] = {"prompts": len(wide_prompts), "acceptance_rate": m48["acceptance_rate"],
                                      "mean_acceptance_length": m48["mean_acceptance_length"],
                                      "acceptance_per_position": m48["acceptance_per_position"]}
    print(json.dumps({k: v for k, v in result.items() if k not in ("prompts", "draft")}, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
