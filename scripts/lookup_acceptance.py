"""Can prompt lookup replace the draft model at some steps? On HumanEval completions (greedy, the
serve-peers stop strings), run the draft-model engine and, at every step it verified, ask what the
n-gram and suffix proposers would have proposed from the same context and how many of those tokens
the target's output keeps (greedy: the output is the target's own continuation, so a lookup draft's
accepted length is its common prefix with the tokens that followed).

    python scripts/lookup_acceptance.py --num-tasks 16 --output-json lookup.json

Prints, per rule "use the lookup when it proposes >= L tokens from an n-gram match >= m": the share
of steps it fires, the lookup's mean accepted tokens there vs the draft model's at those steps, and
a first-order time estimate from the run's own step costs (a lookup step skips the draft passes).
"""
import argparse
import json
import os
import statistics

import numpy as np

from specdec import LLM, SamplingParams
from specdec.bench.serve_tasks import STOP, load_tasks
from specdec.spec_decode.ngram import common_suffix_lengths, earlier_match_ends
from specdec.spec_decode.suffix import SuffixProposer

HOME = os.path.expanduser("~/.cache/specdec")


def ngram_match(context: np.ndarray, max_n: int) -> tuple[int, int]:
    """(longest suffix match length up to max_n, start of the most recent such continuation)."""
    ends = earlier_match_ends(context, 1, max_n)
    if ends.size == 0:
        return 0, -1
    lengths = common_suffix_lengths(context, ends, context[-max_n:])
    best = int(lengths.max())
    return best, int(ends[lengths == best][-1]) + 1


def accepted(draft, truth) -> int:
    n = 0
    for d, t in zip(draft, truth):
        if d != t:
            break
        n += 1
    return n


def step_rows(task_id: str, prompt: list[int], output: list[int], records, suffix: SuffixProposer, k: int,
              costs: dict) -> list[dict]:
    """Per step that verified the draft model's drafts (batch 1): the draft's (drafted, accepted)
    and what the n-gram and suffix lookups would have proposed there and kept. ``suffix`` learns
    the task afterwards, as a server's would; ``costs`` collects the step timings."""
    full = np.asarray(prompt + output, dtype=np.int64)
    rows, position = [], 0  # output tokens committed before the step
    for rec in records:
        res = rec.result
        if rec.scheduled.num_scheduled_tokens[0] == 1 and res.num_draft_tokens[0]:
            context = full[: len(prompt) + position]
            truth = output[position:]
            match, start = ngram_match(context, 16)
            lookup = full[start : min(start + k, len(context))].tolist() if match else []
            suf = suffix._propose_one(context, k)
            rows.append({"task": task_id, "draft_n": res.num_draft_tokens[0], "draft_acc": res.num_accepted_tokens[0],
                         "match": match, "lookup_n": len(lookup), "lookup_acc": accepted(lookup, truth),
                         "suffix_n": len(suf), "suffix_acc": accepted(suf, truth)})
            costs.setdefault("target_s", []).append(res.target_seconds)
        if res.draft_seconds and res.num_draft_passes and res.num_draft_first_pass_rows <= 2:
            costs.setdefault("draft_s", []).append(res.draft_seconds)
        position += rec.num_emitted_tokens[0]
    suffix.on_request_finished("live", full.tolist(), num_prompt_tokens=len(prompt))
    return rows


def rule_table(steps: list[dict], costs: dict, k: int) -> list[dict]:
    """Per rule "the lookup replaces the draft when it proposes >= L tokens from a match >= m":
    how often it fires, both acceptances there, and a first-order speedup estimate (a fired step
    emits the lookup's accepted + 1 tokens for a verification without the draft passes)."""
    verify_s = statistics.median(costs["target_s"])
    draft_s = statistics.median(costs["draft_s"])
    draft_acc = [s["draft_acc"] for s in steps]
    print(f"{len(steps)} verification steps; draft model K={k}: mean accepted {statistics.mean(draft_acc):.2f}; "
          f"median verification {1e3 * verify_s:.0f} ms, median drafting {1e3 * draft_s:.0f} ms (loaded machine)")
    base_tokens = sum(a + 1 for a in draft_acc)
    base_time = len(steps) * (verify_s + draft_s)
    rules = []
    for source in ("lookup", "suffix"):
        for min_match in ((1, 2, 3, 4, 6) if source == "lookup" else (0,)):
            for min_tokens in (1, 2, 3, 4):
                fired = [s for s in steps if s[f"{source}_n"] >= min_tokens and s["match"] >= min_match]
                if not fired:
                    continue
                lk = statistics.mean(s[f"{source}_acc"] for s in fired)
                dm = statistics.mean(s["draft_acc"] for s in fired)
                tokens = base_tokens + sum(s[f"{source}_acc"] - s["draft_acc"] for s in fired)
                time_s = base_time - len(fired) * draft_s
                rule = {"source": "ngram" if source == "lookup" else "suffix", "min_match": min_match,
                        "min_tokens": min_tokens, "fired_share": len(fired) / len(steps), "lookup_accepted": lk,
                        "draft_accepted": dm, "estimated_speedup": (tokens / time_s) / (base_tokens / base_time)}
                rules.append(rule)
                print(f"{rule['source']:6s} match>={min_match} tokens>={min_tokens}: fires {100 * rule['fired_share']:5.1f}% "
                      f"of steps, accepted lookup {lk:.2f} vs draft {dm:.2f}, est. speedup over draft_model "
                      f"{rule['estimated_speedup']:.3f}x", flush=True)
    return rules


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default=f"{HOME}/downloads/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
    parser.add_argument("--tokenizer", default=f"{HOME}/models/Qwen2.5-Coder-1.5B-Instruct")
    parser.add_argument("--draft", default=f"{HOME}/models/Qwen2.5-Coder-0.5B-Instruct")
    parser.add_argument("--k", type=int, default=6)
    parser.add_argument("--num-tasks", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    spec = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k, "quantization": "w4a8",
            "draft_vocab_size": 49152}
    llm = LLM(model=args.target, tokenizer=args.tokenizer, quantization="w4a8", num_threads=2, max_model_len=2048,
              kv_cache_memory=256 << 20, speculative_config=spec)
    records = []
    llm.engine.add_step_observer(records.append)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, stop=STOP)
    tasks = load_tasks("humaneval", args.num_tasks)
    suffix = SuffixProposer(args.k)
    llm.generate([tasks[0].prompt], params, use_tqdm=False)  # warm-up
    steps, costs = [], {}
    for task in tasks:
        records.clear()
        out = llm.generate([task.prompt], params, use_tqdm=False)[0]
        steps += step_rows(task.task_id, list(out.prompt_token_ids), list(out.outputs[0].token_ids), records, suffix,
                           args.k, costs)
        print(task.task_id, len(out.outputs[0].token_ids), "tokens", flush=True)
    rules = rule_table(steps, costs, args.k)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "steps": steps, "rules": rules}, f, indent=1)


if __name__ == "__main__":
    main()
