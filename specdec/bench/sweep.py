"""``specdec bench sweep``: the engine's efficiency surface over (acceptance a, K).

The "replay" proposer proposes the target's own greedy continuation (computed first,
without speculation) and corrupts each token with probability 1 - a, so acceptance is set
by the benchmark, not by a draft model, and drafting costs ~nothing (c ~ 0). For each K an
engine is built (K is fixed per engine), the acceptance is set between runs (the replay
proposer's "set_acceptance" control), and each repetition times, for every a, the plain engine and then the speculative one on the same
prompts (each ratio from two adjacent runs). The bound
uses the *measured* per-token acceptance and cost ratio; efficiency = speedup / bound
isolates the engine's own overhead (a verify step costing more than a plain step,
Python work per step, sampling) from the proposer's quality.
"""
from __future__ import annotations

import gc
import json

from specdec.bench import driver
from specdec.bench.cli import add_common_args, engine_args
from specdec.bench.latency import speculation_figures, summarize_runs
from specdec.bench.report import format_table, median, result_header, run_benchmark
from specdec.bench.roofline import engine_roofline, measure_bandwidth, paired_fraction
from specdec.spec_decode.adaptive import expected_tokens


def add_parser(sub):
    p = sub.add_parser("sweep", help="controlled-acceptance (replay) sweep over acceptance x K: efficiency surface")
    add_common_args(p, output_len=128)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--acceptances", type=float, nargs="+", default=[0.5, 0.7, 0.8, 0.9, 1.0])
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7, 8])
    p.set_defaults(func=run, num_iters=3)
    return p


def run(args) -> int:
    return run_benchmark(args, measure, render, "plot_sweep")


def _replay_args(args, k: int, acceptance: float):
    spec = json.dumps({"method": "replay", "num_speculative_tokens": k, "acceptance": acceptance})
    return engine_args(args, speculative=True, speculative_config=spec, speculative_model=None,
                       no_speculation=False)


def measure(args) -> dict:
    from specdec.cli import make_llm

    if not all(0.0 <= a <= 1.0 for a in args.acceptances) or min(args.ks) < 1:
        raise ValueError("--acceptances must be in [0, 1] and --ks >= 1")
    from specdec.worker.calibrate import time_verify_forward
    from specdec.worker.model_runner import ModelRunner
    from specdec.worker.shared_weights import SharedWeights

    weights = SharedWeights()
    base = make_llm(engine_args(args, speculative=False), target_weights=weights)
    # the model's own price of K + 1 rows: what verification costs on this hardware however little
    # the engine adds around it. Timed on the same weights with a KV cache of its own, right before
    # each pair of runs (the price moves with the VM's bandwidth phase: 1.05x vs 1.28x a row at K=5)
    context = args.input_len + args.output_len // 2
    block_size = base.engine.config.block_size
    blocks = args.batch_size * (-(-(context + max(args.ks) + 1) // block_size))
    probe = ModelRunner(weights.model, blocks, block_size, base.engine.device, base.engine.dtype)

    def forward_ratio_now(k: int) -> float:
        one = time_verify_forward(probe, args.batch_size, 1, context, repeats=2)
        return time_verify_forward(probe, args.batch_size, k + 1, context, repeats=2) / one
    params = driver.greedy_params(args.output_len)
    prompts = driver.make_prompts(base, args.prompts, args.batch_size, args.input_len, seed=args.seed * 7919)
    driver.warmup(base)
    references = driver.timed_generate(base, prompts, params).token_ids  # greedy, no speculation
    cells, bandwidths, base_rates = [], [], []
    for k in args.ks:
        llm = make_llm(_replay_args(args, k, args.acceptances[0]))
        driver.register_references(llm, prompts, references)
        driver.warmup(llm)
        base_runs, spec_runs = {a: [] for a in args.acceptances}, {a: [] for a in args.acceptances}
        ratios = {a: [] for a in args.acceptances}
        for _ in range(args.num_iters):
            bandwidths.append(measure_bandwidth(args.bandwidth_mib << 20, repeats=3, device=base.engine.device))
            for a in args.acceptances:
                # each speculative run right after its own plain run: this VM's memory bandwidth
                # moves between phases minutes long, and a ratio of runs minutes apart moved with it
                ratios[a].append(forward_ratio_now(k))
                base_runs[a].append(driver.timed_generate(base, prompts, params))
                base_rates.append(base_runs[a][-1].decode_tokens_per_s)
                llm.engine.executor.control_proposer("set_acceptance", a)
                spec_runs[a].append(driver.timed_generate(llm, prompts, params))
        for a in args.acceptances:
            cell = {"k": k, "acceptance_set": a, **summarize_runs(spec_runs[a]),
                    **speculation_figures(llm, base_runs[a], spec_runs[a], None)}
            cell["baseline_decode_tokens_per_s"] = median(r.decode_tokens_per_s for r in base_runs[a])
            # the bound with verification priced at what the forward over K + 1 rows measured
            cell["forward_cost_ratio"] = median(ratios[a])
            cell["forward_cost_ratio_per_iter"] = ratios[a]
            cell["hardware_bound"] = expected_tokens(cell["acceptance"]["alpha"], k) / (
                cell["cost_ratio"] * k + cell["forward_cost_ratio"])
            cell["engine_efficiency"] = cell["speedup"] / cell["hardware_bound"]
            cell["greedy_agreement"] = driver.agreement(references * args.num_iters,
                                                        [t for r in spec_runs[a] for t in r.token_ids])
            cells.append(cell)
            print(f"K={k} a={a:.2f}: alpha {cell['acceptance']['alpha']:.3f} speedup {cell['speedup']:.2f} "
                  f"bound {cell['leviathan_bound']:.2f} efficiency {cell['efficiency']:.2f} "
                  f"(forward {cell['forward_cost_ratio']:.2f}x: engine efficiency {cell['engine_efficiency']:.2f})", flush=True)
        del llm
        gc.collect()
    bandwidth = median(bandwidths)
    roof = engine_roofline(base, bandwidth, args.input_len + args.output_len / 2, args.batch_size)
    base_tps = median(base_rates)
    result = result_header(args, "sweep", bandwidth, base.engine.device)
    result.update(
        config={"model": base.engine.model_path, "dtype": str(base.engine.dtype).removeprefix("torch."),
                "batch_size": args.batch_size, "input_len": args.input_len, "output_len": args.output_len,
                "num_iters": args.num_iters, "prompts": args.prompts, "acceptances": args.acceptances,
                "ks": args.ks},
        roofline={**roof.as_dict(), "bandwidth_gb_per_s_per_iter": [b / 1e9 for b in bandwidths]},
        baseline={"decode_tokens_per_s": base_tps, "decode_tokens_per_s_per_iter": base_rates},
        roofline_fraction=paired_fraction(base_rates, bandwidths, roof),
        cells=cells,
    )
    return result


def render(result: dict) -> str:
    cfg, roof = result["config"], result["roofline"]
    lines = [f"model {cfg['model']} ({cfg['dtype']}), batch {cfg['batch_size']}, input {cfg['input_len']}, "
             f"output {cfg['output_len']}, {cfg['num_iters']} iterations (medians); plain decoding "
             f"{result['baseline']['decode_tokens_per_s']:.2f} tok/s = {result['roofline_fraction']:.2f} of the "
             f"roofline ({roof['tokens_per_s']:.2f} tok/s at {roof['bandwidth_gb_per_s']:.1f} GB/s)"]
    headers = ["K", "a set", "alpha", "accept rate", "mean acc len", "step cost", "fwd cost", "c", "bound",
               "hw bound", "speedup", "efficiency", "engine eff"]
    rows = [[c["k"], c["acceptance_set"], c["acceptance"]["alpha"], c["acceptance"]["acceptance_rate"],
             c["acceptance"]["mean_acceptance_length"], c["verify_step_cost_ratio"], c.get("forward_cost_ratio"),
             c["cost_ratio"], c["leviathan_bound"], c.get("hardware_bound"), c["speedup"], c["efficiency"],
             c.get("engine_efficiency")] for c in result["cells"]]
    lines.append("bound: Leviathan (verification free); hw bound: verification priced at the measured forward "
                 "over K + 1 rows (fwd cost, x one row); engine eff = speedup / hw bound (the engine's own overhead)")
    lines.append(format_table(headers, rows))
    ks = cfg["ks"]
    for key, title in (("efficiency", "efficiency vs the Leviathan bound"),
                       ("engine_efficiency", "engine efficiency vs the hardware bound")):
        eff = {(c["acceptance_set"], c["k"]): c.get(key) for c in result["cells"]}
        lines.append(f"{title} (rows: a, columns: K)")
        lines.append(format_table(["a \\ K"] + [str(k) for k in ks],
                                  [[a] + [eff.get((a, k)) for k in ks] for a in cfg["acceptances"]]))
    return "\n\n".join(lines)
