"""Mean acceptance length of a draft for the default target on train-draft's 48 held-out prompts
(24 chat + 24 code, subjects not in its corpus), greedy, generated as one batch: a K=5 chain and
a depth-5 token tree. No timing (acceptance does not depend on it), so it runs on a busy machine.
The same prompts and settings as ``default_pair_eval.py``'s ``*_heldout48`` figures.
Run: python scripts/heldout_acceptance.py [--draft DIR] [--tree-topk 6] [--tree-nodes 24] [--max-tokens 96]
"""
import argparse
import json

from specdec import LLM, SamplingParams
from specdec.models.default import DEFAULT_DRAFT_DIR, DEFAULT_TARGET, draft_spec_config
from specdec.training.draft_corpus import HELDOUT_CHAT, HELDOUT_CODE


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT_DIR), help="draft folder (default: the shipped one)")
    ap.add_argument("--tree-topk", type=int, default=6)
    ap.add_argument("--tree-nodes", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    chain = {k: v for k, v in draft_spec_config(args.draft, 5).items() if k not in ("tree_topk", "tree_nodes")}
    configs = {"k5": chain, "k5_tree": chain | {"tree_topk": args.tree_topk, "tree_nodes": args.tree_nodes}}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    result = {"draft": args.draft, "method": chain["method"]}
    for name, cfg in configs.items():
        llm = LLM(model=DEFAULT_TARGET, max_model_len=1024, speculative_config=cfg)
        prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in HELDOUT_CHAT + HELDOUT_CODE]
        llm.generate(prompts, params, use_tqdm=False)
        m = llm.get_metrics()
        result[name] = {"prompts": len(prompts), "mean_acceptance_length": round(m["mean_acceptance_length"], 3),
                        "acceptance_per_position": [round(a, 3) for a in m["acceptance_per_position"]]}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
