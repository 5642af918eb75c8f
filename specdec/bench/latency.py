"""``specdec bench latency``: one batch, decode tokens/s against the roofline, and speculation.

With a speculative config two engines are built on the same checkpoint, one without
speculation, and their runs alternate (A B A B ...) over the same prompts, so the speedup
is a ratio measured side by side. Efficiency = speedup / the Leviathan bound computed from
the measured per-token acceptance ``alpha`` and the measured draft-to-target cost ``c``.
"""
from __future__ import annotations

from specdec.bench import driver
from specdec.bench.cli import add_common_args, engine_args, has_speculation
from specdec.bench.leviathan import leviathan_bound
from specdec.bench.report import format_table, median, result_header, run_benchmark
from specdec.bench.roofline import (
    engine_roofline,
    measure_bandwidth,
    measure_matmul_flops,
    paired_fraction,
)
from specdec.spec_decode.metrics import AcceptanceCounts


def add_parser(sub):
    p = sub.add_parser("latency", help="decode tokens/s of one batch vs the roofline (and vs no speculation)")
    add_common_args(p)
    p.add_argument("--batch-size", type=int, default=1)
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    return run_benchmark(args, measure, render, "plot_latency")


def summarize_runs(runs: list[driver.RunResult]) -> dict:
    """Medians over repetitions (each figure separately) plus the per-repetition decode rates."""
    keys = ("prefill_s", "decode_s", "decode_tokens_per_s", "prefill_tokens_per_s", "total_tokens_per_s",
            "decode_step_ms")
    summaries = [r.summary() for r in runs]
    out = {k: median(s[k] for s in summaries) for k in keys}
    out["decode_tokens_per_s_per_iter"] = [s["decode_tokens_per_s"] for s in summaries]
    out["num_decode_tokens"] = summaries[0]["num_decode_tokens"]
    out["num_decode_steps"] = median(s["num_decode_steps"] for s in summaries)
    out["decode_breakdown_s"] = {k: median(s["decode_breakdown_s"][k] for s in summaries)
                                 for k in summaries[0]["decode_breakdown_s"]}
    return out


def speculation_figures(llm, base_runs, spec_runs, cost: dict | None) -> dict:
    """Acceptance, cost ratio, bound, speedup and efficiency from paired runs."""
    counts = AcceptanceCounts()
    for r in spec_runs:
        counts.merge(r.acceptance)
    spec_cfg = llm.engine.config.speculative_config
    k = counts.mean_k if spec_cfg.is_adaptive else spec_cfg.max_k
    speedups = [s.decode_tokens_per_s / b.decode_tokens_per_s for b, s in zip(base_runs, spec_runs)]
    if cost is None:  # a draft-free proposer: its measured time per step, per draft token, in target steps
        ratios = [s.decode_breakdown_s["drafting"] / max(s.num_decode_steps, 1) / max(k, 1) / b.decode_step_s
                  for b, s in zip(base_runs, spec_runs)]
        cost = {"cost_ratio": median(ratios), "source": "engine drafting time per step / K / plain step time"}
    c = cost["cost_ratio"]
    bound = leviathan_bound(counts.alpha, round(k), c)  # adaptive K: the bound at the mean K, rounded (an int)
    speedup = median(speedups)
    step_cost = median(s.decode_step_s / b.decode_step_s for b, s in zip(base_runs, spec_runs))
    return {
        "method": spec_cfg.method, "num_speculative_tokens": spec_cfg.num_speculative_tokens, "k": k,
        "acceptance": counts.as_dict(), "cost": cost, "cost_ratio": c,
        "leviathan_bound": bound, "bound_from_mean_acceptance_length": counts.mean_acceptance_length / (c * k + 1),
        "speedup": speedup, "speedup_per_iter": speedups, "efficiency": speedup / bound,
        "verify_step_cost_ratio": step_cost,  # a speculative step's time / a plain step's time
    }


def measure(args) -> dict:
    from specdec.cli import make_llm

    if args.batch_size < 1 or args.num_iters < 1:
        raise ValueError("--batch-size and --num-iters must be >= 1")
    speculative = has_speculation(args)
    llm = make_llm(engine_args(args, speculative=speculative))
    base = make_llm(engine_args(args, speculative=False)) if speculative else llm
    cost = driver.draft_cost_ratio(llm, args.batch_size) if speculative else None  # before any request
    params = driver.greedy_params(args.output_len, args.temperature, seed=args.seed if args.temperature else None)
    driver.warmup(base)
    if speculative:
        driver.warmup(llm)
    base_runs, spec_runs, bandwidths = [], [], []
    def bandwidth_now() -> float:
        return measure_bandwidth(args.bandwidth_mib << 20, repeats=3, device=base.engine.device)

    for rep in range(args.num_iters):
        before = bandwidth_now()
        prompts = driver.make_prompts(base, args.prompts, args.batch_size, args.input_len, seed=args.seed * 7919 + rep)
        base_runs.append(driver.timed_generate(base, prompts, params))
        # a shared host's bandwidth drifts within minutes: pair the run with the mean of the
        # copies just before and just after it
        bandwidths.append((before + bandwidth_now()) / 2)
        if speculative:  # same prompts; a replay proposer gets the plain run's output as its reference
            driver.register_references(llm, prompts, base_runs[-1].token_ids)
            spec_runs.append(driver.timed_generate(llm, prompts, params))
    bandwidth = median(bandwidths)
    flops = measure_matmul_flops(base.engine.dtype, base.engine.device)
    roof = engine_roofline(base, bandwidth, args.input_len + args.output_len / 2, args.batch_size, flops)
    baseline = summarize_runs(base_runs)
    base_rates = [r.decode_tokens_per_s for r in base_runs]
    result = result_header(args, "latency", bandwidth, base.engine.device)
    result.update(
        config={"model": base.engine.model_path, "dtype": str(base.engine.dtype).removeprefix("torch."),
                "batch_size": args.batch_size, "input_len": args.input_len, "output_len": args.output_len,
                "num_iters": args.num_iters, "prompts": args.prompts, "temperature": args.temperature,
                "speculative_config": args.speculative_config or args.speculative_model},
        roofline={**roof.as_dict(), "bandwidth_gb_per_s_per_iter": [b / 1e9 for b in bandwidths]},
        baseline=baseline,
        roofline_fraction=paired_fraction(base_rates, bandwidths, roof),
        attainable_fraction=paired_fraction(base_rates, bandwidths, roof, attainable=True),
        speculative=None,
    )
    if speculative:
        spec = summarize_runs(spec_runs)
        spec.update(speculation_figures(llm, base_runs, spec_runs, cost))
        # > 1: beyond what plain decoding can reach
        spec["roofline_fraction"] = paired_fraction([r.decode_tokens_per_s for r in spec_runs], bandwidths, roof)
        if args.temperature == 0:
            spec["greedy_agreement"] = driver.agreement(
                [t for r in base_runs for t in r.token_ids], [t for r in spec_runs for t in r.token_ids])
        result["speculative"] = spec
    return result


def compute_roof_text(roof: dict, attainable_fraction: float | None) -> str:
    if not roof.get("compute_tokens_per_s"):
        return ""
    text = (f"; compute {roof['flops_per_s'] / 1e9:.0f} GFLOP/s -> {roof['compute_tokens_per_s']:.1f} tokens/s; "
            f"bound by {roof['bound_by']}")
    if roof["bound_by"] == "compute" and attainable_fraction is not None:
        text += f" (measured = {attainable_fraction:.2f} of the compute roof)"
    return text


def render(result: dict) -> str:
    cfg, roof, base, spec = result["config"], result["roofline"], result["baseline"], result["speculative"]
    lines = [
        f"model {cfg['model']} ({cfg['dtype']}), batch {cfg['batch_size']}, input {cfg['input_len']}, "
        f"output {cfg['output_len']}, {cfg['num_iters']} iterations (medians)",
        f"roofline: bandwidth {roof['bandwidth_gb_per_s']:.1f} GB/s, {roof['gb_per_step']:.3f} GB/step "
        f"-> {roof['tokens_per_s']:.2f} tokens/s" + compute_roof_text(roof, result.get("attainable_fraction")),
    ]
    headers = ["engine", "decode tok/s", "roofline frac", "prefill ms", "step ms", "accept rate", "alpha",
               "mean acc len", "c", "bound", "speedup", "efficiency"]
    rows = [["no speculation", base["decode_tokens_per_s"], result["roofline_fraction"], 1e3 * base["prefill_s"],
             base["decode_step_ms"], None, None, None, None, None, 1.0, None]]
    if spec:
        acc = spec["acceptance"]
        rows.append([f"{spec['method']} K={spec['num_speculative_tokens']}", spec["decode_tokens_per_s"],
                     spec["roofline_fraction"], 1e3 * spec["prefill_s"], spec["decode_step_ms"],
                     acc["acceptance_rate"], acc["alpha"], acc["mean_acceptance_length"], spec["cost_ratio"],
                     spec["leviathan_bound"], spec["speedup"], spec["efficiency"]])
    lines.append(format_table(headers, rows))
    if spec and "greedy_agreement" in spec:
        agree = spec["greedy_agreement"]
        lines.append(f"greedy outputs identical to no-speculation: {agree['identical_fraction']:.2f} "
                     f"of sequences (mean prefix agreement {agree['mean_prefix_agreement']:.3f})")
    return "\n\n".join(lines)
