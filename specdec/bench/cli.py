"""``specdec bench {latency,throughput,sweep,compare,serve,make-model}``.

Every command prints a table, measures the machine's roofline in the same process, and
can write ``--output-json`` (the input of scripts/make_benchmarks_md.py) and ``--plot``.
"""
from __future__ import annotations

import argparse
import copy

BENCH_COMMANDS = ("latency", "throughput", "sweep", "compare", "profile")


def add_common_args(p: argparse.ArgumentParser, output_len: int = 128) -> None:
    from specdec.cli import add_engine_args

    add_engine_args(p)
    g = p.add_argument_group("benchmark")
    g.add_argument("--input-len", type=int, default=128, help="prompt tokens (exactly)")
    g.add_argument("--output-len", type=int, default=output_len, help="generated tokens (EOS ignored)")
    g.add_argument("--prompts", default="random", choices=["random", "text", "code"],
                   help="random token ids, windows of fixed source text, or the 8 code-completion prompts")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--num-iters", type=int, default=5, help="timed repetitions (A/B interleaved; medians)")
    g.add_argument("--bandwidth-mib", type=int, default=512, help="buffer size of the bandwidth copy test")
    g.add_argument("--output-json", default=None)
    g.add_argument("--plot", default=None, metavar="FILE.png")


def engine_args(args, speculative: bool = True, **overrides):
    """A copy of ``args`` for ``make_llm``: optionally without speculation, bench-sized KV."""
    a = copy.copy(args)
    if not speculative:
        a.speculative_config = None
        a.speculative_model = None
        a.no_speculation = True
    if a.max_model_len is None:  # KV sized for the benchmark, not the model's full context
        a.max_model_len = args.input_len + args.output_len + 32
    for key, value in overrides.items():
        setattr(a, key, value)
    return a


def has_speculation(args) -> bool:
    """A speculative config or draft was given, or no --model: the embedded default pair speculates."""
    if args.no_speculation:
        return False
    return bool(args.speculative_config or args.speculative_model or args.model is None)


def register_cli(subparsers) -> None:
    from specdec.bench import autok, compare, latency, profile, quant_kernels, roofline_dtypes, sweep, throughput

    bench = subparsers.add_parser(
        "bench", help="benchmarks: latency, throughput, sweep, autok, compare, profile, quant-kernels, roofline, "
                      "workloads, structured, peers, serve, serve-peers")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    for module in (latency, throughput, sweep, autok, compare, profile, quant_kernels, roofline_dtypes):
        p = module.add_parser(sub)
        p.set_defaults(bench_parser=p)
    _register_serve(sub)
    from specdec.bench.workloads import add_workloads_parser

    add_workloads_parser(sub).set_defaults(bench_parser=sub.choices["workloads"])
    from specdec.bench.structured import add_structured_parser

    add_structured_parser(sub).set_defaults(bench_parser=sub.choices["structured"])
    from specdec.bench.peers.command import add_peers_parser

    add_peers_parser(sub).set_defaults(bench_parser=sub.choices["peers"])
    from specdec.bench.serve_peers import add_serve_peers_parser

    add_serve_peers_parser(sub).set_defaults(bench_parser=sub.choices["serve-peers"])
    if "serve" in sub.choices:
        sub.choices["serve"].set_defaults(bench_parser=sub.choices["serve"])
    m = sub.add_parser("make-model", help="write a random checkpoint for benchmarks (speed ignores weights)")
    m.add_argument("out")
    m.add_argument("--preset", default="tinyllama-1.1b", choices=["tinyllama-1.1b", "tiny"])
    m.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    m.add_argument("--unstructured", action="store_true",
                   help="plain random init (flat logits: bf16 greedy flips between batch shapes)")
    m.add_argument("--draft-layers", type=int, default=None,
                   help="instead: write a draft made of the first N layers of --from-target")
    m.add_argument("--from-target", default=None, help="target folder for --draft-layers")
    m.add_argument("--corrupt-fraction", type=float, default=0.0,
                   help="draft only: shuffle this fraction of its lm_head rows (acceptance ~ 1 - fraction)")
    m.set_defaults(func=cmd_make_model)


def _register_serve(sub) -> None:
    import importlib

    try:
        module = importlib.import_module("specdec.bench.serve")
    except ModuleNotFoundError as e:
        if e.name != "specdec.bench.serve":
            raise
        return
    module.add_serve_parser(sub)


def cmd_make_model(args) -> int:
    from specdec.bench.models import make_layer_skip_draft, make_random_llama

    if args.draft_layers is not None:
        if not args.from_target:
            raise ValueError("--draft-layers needs --from-target TARGET_DIR")
        print(make_layer_skip_draft(args.from_target, args.out, args.draft_layers, args.corrupt_fraction))
    else:
        print(make_random_llama(args.out, args.preset, args.dtype, predictable=not args.unstructured))
    return 0
