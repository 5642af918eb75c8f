"""``specdec bench autok``: "auto" K against every fixed K, paired on one engine.

One engine with ``"num_speculative_tokens": "auto"`` serves every policy: for each prompt the
policies run in turn (the order rotating from prompt to prompt), a fixed K through
``EngineCore.set_speculation_policy(SpecController.fixed(k))`` (the steps of a fixed K teach
"auto" nothing). Decode tokens/s per policy
and round, and the paired figures: "auto" over the best fixed K of the same round, and over the
fixed K chosen on held-out prompts (``held_out_ratio``). Separate engine
processes on a shared machine can differ between runs by more than neighbouring K do; alternating
policies prompt by prompt on one engine leaves the comparison to the K choice.
"""
from __future__ import annotations

import random

from specdec.bench import driver
from specdec.bench.cli import add_common_args, engine_args
from specdec.bench.report import format_table, median, result_header, run_benchmark
from specdec.bench.roofline import measure_bandwidth
from specdec.spec_decode.controller import SpecController
from specdec.spec_decode.metrics import AcceptanceCounts


def add_parser(sub):
    p = sub.add_parser("autok", help='"auto" K vs every fixed K, alternating on one engine')
    add_common_args(p)
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per round, each run once per policy")
    p.add_argument("--k-values", default=None,
                   help="comma-separated fixed K to compare (default: 1 .. max_num_speculative_tokens)")
    p.set_defaults(func=run, prompts="code", num_iters=2)
    return p


def run(args) -> int:
    return run_benchmark(args, measure, render)


def parse_k_values(text: str | None, max_k: int) -> list[int]:
    if text is None:
        return list(range(1, max_k + 1))
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--k-values must be comma-separated integers, got {text!r}") from None
    bad = [k for k in values if not 0 <= k <= max_k]
    if not values or bad:
        raise ValueError(f"--k-values must be integers in [0, {max_k}] (max_num_speculative_tokens), got {text!r}")
    return sorted(set(values))


def measure(args) -> dict:
    from specdec.cli import make_llm

    if args.num_prompts < 1 or args.num_iters < 1:
        raise ValueError("--num-prompts and --num-iters must be >= 1")
    llm = make_llm(engine_args(args))
    ctl = llm.engine.spec_controller
    spec = llm.engine.config.speculative_config
    if ctl is None or not spec.is_adaptive or spec.is_tree:
        raise ValueError('bench autok needs a chain speculative config with "num_speculative_tokens": "auto"')
    policies = ["auto"] + parse_k_values(args.k_values, ctl.max_k)
    params = driver.greedy_params(args.output_len, args.temperature, seed=args.seed if args.temperature else None)
    bandwidth = measure_bandwidth(args.bandwidth_mib << 20, repeats=3, device=llm.engine.device)
    driver.warmup(llm)
    prompts = driver.make_prompts(llm, args.prompts, args.num_prompts, args.input_len, seed=args.seed)
    rounds = []
    for _ in range(args.num_iters):
        per_prompt = {p: [(0, 0.0)] * len(prompts) for p in policies}  # (tokens, seconds) of each prompt
        counts = {p: AcceptanceCounts() for p in policies}
        for i, prompt in enumerate(prompts):
            shift = (i + len(rounds)) % len(policies)
            for policy in policies[shift:] + policies[:shift]:
                auto = None if policy == "auto" else llm.engine.set_speculation_policy(SpecController.fixed(policy))
                try:
                    out = driver.timed_generate(llm, [prompt], params)
                finally:
                    if auto is not None:
                        llm.engine.set_speculation_policy(auto)
                per_prompt[policy][i] = (out.num_decode_tokens, out.decode_s)
                counts[policy].merge(out.acceptance)
        rates = {p: _rate(per_prompt[p], range(len(prompts))) for p in policies}
        best_k = max(policies[1:], key=rates.get)
        rounds.append({"tokens_per_s": {str(p): r for p, r in rates.items()},
                       "mean_acceptance_length": {str(p): c.mean_acceptance_length if c.num_drafts else 1.0
                                                  for p, c in counts.items()},
                       "best_fixed_k": best_k, "auto_over_best_fixed": rates["auto"] / rates[best_k],
                       "auto_over_held_out_k": held_out_ratio(per_prompt, policies[1:])})
    result = result_header(args, "autok", bandwidth, llm.engine.device)
    held_out = [r["auto_over_held_out_k"] for r in rounds if r["auto_over_held_out_k"] is not None]
    result.update(
        auto_over_held_out_k=median(held_out) if held_out else None,
        config={"model": llm.engine.model_path, "speculative_config": args.speculative_config,
                "max_num_speculative_tokens": ctl.max_k, "num_prompts": args.num_prompts, "prompts": args.prompts,
                "output_len": args.output_len, "temperature": args.temperature, "rounds": args.num_iters},
        policies=[str(p) for p in policies], rounds=rounds,
        tokens_per_s={str(p): median(r["tokens_per_s"][str(p)] for r in rounds) for p in policies},
        auto_over_best_fixed=median(r["auto_over_best_fixed"] for r in rounds),
    )
    return result


def _rate(runs: list[tuple[int, float]], idx) -> float:
    """Decode tokens/s over the prompts ``idx`` of one policy's (tokens, seconds) per prompt."""
    spent = sum(runs[i][1] for i in idx)
    return sum(runs[i][0] for i in idx) / spent if spent > 0 else 0.0


def held_out_ratio(per_prompt: dict, fixed: list, num_splits: int = 200, seed: int = 0) -> float | None:
    """"auto" against the fixed K a user would have picked without seeing these prompts: the
    prompts are split in random halves; the K fastest on one half is scored on the other, and so
    is "auto"; the median ratio over the splits (both directions). "Best fixed K" of the same
    prompts picks, in hindsight, the K whose draft windows happened to fall best on them: over a
    flat optimum that is the best of several draws, and biased up. None with under 2 prompts."""
    n = len(per_prompt["auto"])
    if n < 2:
        return None

    def rate(policy, idx):
        return _rate(per_prompt[policy], idx)

    rng = random.Random(seed)
    ratios = []
    for _ in range(num_splits):
        order = list(range(n))
        rng.shuffle(order)
        halves = order[: n // 2], order[n // 2:]
        for chosen_on, scored_on in (halves, halves[::-1]):
            k = max(fixed, key=lambda p: rate(p, chosen_on))
            if rate(k, scored_on) > 0:
                ratios.append(rate("auto", scored_on) / rate(k, scored_on))
    return median(ratios) if ratios else None


def render(result: dict) -> str:
    rounds = result["rounds"]
    best = max((result["tokens_per_s"][p] for p in result["policies"][1:]), default=None)
    rows = [[p if p == "auto" else f"K={p}",
             " / ".join(f"{r['tokens_per_s'][p]:.2f}" for r in rounds),
             f"{result['tokens_per_s'][p]:.2f}",
             f"{median(r['mean_acceptance_length'][p] for r in rounds):.2f}",
             f"{result['tokens_per_s'][p] / best:.3f}" if best else "-"] for p in result["policies"]]
    head = (f"{result['config']['model']}: {result['config']['num_prompts']} {result['config']['prompts']} prompts x "
            f"{result['config']['output_len']} tokens, policies alternating per prompt on one engine")
    table = format_table(["policy", "decode tok/s per round", "median", "MAL", "/ best fixed"], rows)
    paired = " / ".join(f"{r['auto_over_best_fixed']:.3f} (K={r['best_fixed_k']})" for r in rounds)
    held = result.get("auto_over_held_out_k")
    held_text = "" if held is None else (f"\nauto / the fixed K that was fastest on the other half of the prompts (random "
                                         f"halves): median {held:.3f}")
    return (f"{head}\n\n{table}\n\nauto / best fixed K of the same round: {paired}; median "
            f"{result['auto_over_best_fixed']:.3f}{held_text}")
