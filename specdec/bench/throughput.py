"""``specdec bench throughput``: tokens/s as the batch grows, against the batch's roofline.

For each batch size B, ``--waves`` x B requests are queued at once with ``max_num_seqs = B``
(so B run concurrently). Decoding B sequences still reads the weights once per step, so
the roofline grows almost linearly in B until the KV reads or compute take over.
"""
from __future__ import annotations

from specdec.bench import driver
from specdec.bench.cli import add_common_args, engine_args, has_speculation
from specdec.bench.latency import speculation_figures, summarize_runs
from specdec.bench.report import format_table, median, result_header, run_benchmark
from specdec.bench.roofline import (
    engine_roofline,
    measure_bandwidth,
    measure_matmul_flops,
    paired_fraction,
)


def add_parser(sub):
    p = sub.add_parser("throughput", help="tokens/s vs batch size, with the roofline of each batch")
    add_common_args(p)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--waves", type=int, default=1, help="requests per batch size = waves * B")
    p.set_defaults(func=run, num_iters=3)
    return p


def run(args) -> int:
    return run_benchmark(args, measure, render, "plot_throughput")


def measure(args) -> dict:
    from specdec.cli import make_llm

    if min(args.batch_sizes) < 1 or args.waves < 1:
        raise ValueError("--batch-sizes and --waves must be >= 1")
    speculative = has_speculation(args)
    max_b = max(args.batch_sizes)
    llm = make_llm(engine_args(args, speculative=speculative, max_num_seqs=max_b))
    base = make_llm(engine_args(args, speculative=False, max_num_seqs=max_b)) if speculative else llm
    cost = driver.draft_cost_ratio(llm, 1) if speculative else None
    params = driver.greedy_params(args.output_len, args.temperature, seed=args.seed if args.temperature else None)
    driver.warmup(base)
    if speculative:
        driver.warmup(llm)
    flops = measure_matmul_flops(base.engine.dtype, base.engine.device)
    rows, all_bandwidths = [], []
    for b in args.batch_sizes:
        for engine_llm in {id(base): base, id(llm): llm}.values():
            engine_llm.engine.set_max_num_seqs(b)  # concurrency = B for this row
        base_runs, spec_runs, bandwidths = [], [], []
        for rep in range(args.num_iters):
            bandwidths.append(measure_bandwidth(args.bandwidth_mib << 20, repeats=3, device=base.engine.device))
            all_bandwidths.append(bandwidths[-1])
            prompts = driver.make_prompts(base, args.prompts, b * args.waves, args.input_len,
                                          seed=args.seed * 7919 + 101 * b + rep)
            base_runs.append(driver.timed_generate(base, prompts, params))
            if speculative:
                driver.register_references(llm, prompts, base_runs[-1].token_ids)
                spec_runs.append(driver.timed_generate(llm, prompts, params))
        roof = engine_roofline(base, median(bandwidths), args.input_len + args.output_len / 2, b, flops)
        row = {"batch_size": b, "num_requests": b * args.waves,
               "roofline": {**roof.as_dict(), "bandwidth_gb_per_s_per_iter": [x / 1e9 for x in bandwidths]},
               "baseline": summarize_runs(base_runs)}
        base_rates = [r.decode_tokens_per_s for r in base_runs]
        row["roofline_fraction"] = paired_fraction(base_rates, bandwidths, roof)
        row["attainable_fraction"] = paired_fraction(base_rates, bandwidths, roof, attainable=True)
        if speculative:
            spec = summarize_runs(spec_runs)
            spec.update(speculation_figures(llm, base_runs, spec_runs, cost))
            spec["roofline_fraction"] = paired_fraction([r.decode_tokens_per_s for r in spec_runs], bandwidths, roof)
            row["speculative"] = spec
        rows.append(row)
        print(f"batch {b}: {row['baseline']['decode_tokens_per_s']:.2f} decode tok/s "
              f"({row['roofline_fraction']:.2f} of roofline)", flush=True)
    result = result_header(args, "throughput", median(all_bandwidths), base.engine.device)
    result.update(
        config={"model": base.engine.model_path, "dtype": str(base.engine.dtype).removeprefix("torch."),
                "batch_sizes": args.batch_sizes, "waves": args.waves, "input_len": args.input_len,
                "output_len": args.output_len, "num_iters": args.num_iters, "prompts": args.prompts,
                "temperature": args.temperature,
                "speculative_config": args.speculative_config or args.speculative_model},
        rows=rows,
    )
    return result


def render(result: dict) -> str:
    cfg = result["config"]
    lines = [f"model {cfg['model']} ({cfg['dtype']}), input {cfg['input_len']}, output {cfg['output_len']}, "
             f"{cfg['num_iters']} iterations (medians), bandwidth {result['machine']['bandwidth_gb_per_s']:.1f} GB/s"]
    headers = ["batch", "decode tok/s", "total tok/s", "roofline tok/s", "roofline frac", "compute roof tok/s",
               "attainable frac", "step ms", "prefill s"]
    speculative = any("speculative" in r for r in result["rows"])
    if speculative:
        headers += ["spec decode tok/s", "alpha", "speedup", "efficiency"]
    rows = []
    for r in result["rows"]:
        base = r["baseline"]
        row = [r["batch_size"], base["decode_tokens_per_s"], base["total_tokens_per_s"], r["roofline"]["tokens_per_s"],
               r["roofline_fraction"], r["roofline"].get("compute_tokens_per_s"), r.get("attainable_fraction"),
               base["decode_step_ms"], base["prefill_s"]]
        if speculative:
            s = r["speculative"]
            row += [s["decode_tokens_per_s"], s["acceptance"]["alpha"], s["speedup"], s["efficiency"]]
        rows.append(row)
    lines.append(format_table(headers, rows))
    return "\n\n".join(lines)
