"""``specdec bench roofline``: batch-1 decode of one model loaded with each of several ``dtype`` values
("bfloat16", "auto", ...), the engines alternated in one process, each against the memory roofline of the
weights it actually loaded (``roofline.engine_roofline``) at the copy bandwidth measured around its run.

It answers "does ``dtype="bfloat16"`` get this machine's fastest bf16 path?": each fraction is measured
tokens/s over bandwidth / bytes per step, paired per repetition with the bandwidth measured just before
and after that run (a shared machine's bandwidth drifts), median over repetitions.
"""
from __future__ import annotations

import argparse

from specdec.bench import driver
from specdec.bench.cli import add_common_args, engine_args
from specdec.bench.report import format_table, median, result_header, run_benchmark
from specdec.bench.roofline import engine_roofline, measure_bandwidth, paired_fraction


def add_parser(sub):
    p = sub.add_parser("roofline", help="batch-1 decode per dtype (alternated) as a fraction of the memory roofline")
    add_common_args(p, output_len=64)
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "auto"], help="dtype values to load the model with")
    p.set_defaults(func=run, num_iters=3, no_speculation=True)
    return p


def run(args: argparse.Namespace) -> int:
    return run_benchmark(args, measure, render)


def measure(args) -> dict:
    from specdec.cli import make_llm

    if args.num_iters < 1 or not args.dtypes:
        raise ValueError("--num-iters must be >= 1 and --dtypes name at least one dtype")
    llms = {d: make_llm(engine_args(args, speculative=False, dtype=d)) for d in args.dtypes}
    params = driver.greedy_params(args.output_len)
    for llm in llms.values():
        driver.warmup(llm)
    device = next(iter(llms.values())).engine.device
    rates = {d: [] for d in llms}
    bandwidths = {d: [] for d in llms}
    for rep in range(args.num_iters):
        for d, llm in llms.items():  # alternated: every dtype sees the same load, rep by rep
            before = measure_bandwidth(args.bandwidth_mib << 20, repeats=3, device=device)
            prompts = driver.make_prompts(llm, args.prompts, 1, args.input_len, seed=args.seed * 7919 + rep)
            rates[d].append(driver.timed_generate(llm, prompts, params).decode_tokens_per_s)
            bandwidths[d].append((before + measure_bandwidth(args.bandwidth_mib << 20, repeats=3, device=device)) / 2)
    result = result_header(args, "roofline", median(b for bs in bandwidths.values() for b in bs), device)
    engines = []
    for d, llm in llms.items():
        roof = engine_roofline(llm, median(bandwidths[d]), args.input_len + args.output_len / 2)
        engines.append({"dtype": d, "engine_dtype": str(llm.engine.dtype).removeprefix("torch."),
                        "decode_tokens_per_s": median(rates[d]), "decode_tokens_per_s_per_iter": rates[d],
                        "bandwidth_gb_per_s_per_iter": [b / 1e9 for b in bandwidths[d]],
                        "roofline": roof.as_dict(),
                        "roofline_fraction": paired_fraction(rates[d], bandwidths[d], roof)})
    result.update(config={"model": args.model, "input_len": args.input_len, "output_len": args.output_len,
                          "num_iters": args.num_iters, "prompts": args.prompts}, engines=engines)
    return result


def render(result: dict) -> str:
    rows = [[e["dtype"], e["engine_dtype"], e["decode_tokens_per_s"], e["roofline"]["tokens_per_s"],
             e["roofline"]["gb_per_step"], e["roofline_fraction"]] for e in result["engines"]]
    return format_table(["dtype", "computes in", "decode tok/s", "roofline tok/s", "GB/step", "roofline frac"], rows)
