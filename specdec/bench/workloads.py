"""``specdec bench workloads``: draft-free speculation on the workloads it is for, and against.

- ``grounded``: edit a given Python function and print it back whole (outputs repeat long spans
  of the prompt): where prompt lookup / suffix decoding should pay most. The answer cap
  (``--grounded-output-len``, 1024) leaves room for the whole function: a cap below it would
  time a truncated edit, mostly the prompt's prefill (~2,400 prompt tokens in all, which no
  proposer speeds up).
- ``open``: open-ended writing with no source to copy: drafts are poor, and ``"auto"`` must
  stay within a few percent of no speculation.
- ``batch``: many open-ended requests at once (verification is no longer free): ``"auto"``
  must never be slower than speculation off.
Every configuration runs on the same engine weights (one copy in memory, shared), same prompts,
same sampling, in one process, interleaved over repetitions; the table reports median tokens/s and the median of
per-repetition speedups vs off, after ``--warmup`` untimed runs of every configuration (a fresh
engine's first run at a workload's shapes measured 0.91x a warm plain engine's with no
speculation in it at all). Each repetition starts the rotation one configuration later (no
configuration always runs right after the same other one) and every timed run starts after a
garbage collection. The open and batch workloads' runs are short (~5 s), so they get
``--short-repeats`` repetitions (default 3 x ``--repeats``), and an A/A control: ``off-again``,
a second engine without speculation, timed like the others against ``off``. Its spread is this
machine's noise floor, the yardstick for "within 3%" and "never slower".
"""
from __future__ import annotations

import gc
import inspect
import statistics
import time

from specdec.sampling_params import SamplingParams

EDIT_SOURCES = ("textwrap.dedent", "json.dumps", "shlex.quote", "fnmatch.translate")
OPEN_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Describe your ideal weekend in the mountains.",
    "Explain to a child why the sky is blue, in a friendly tone.",
    "Write a poem about the first snow of winter.",
)


def _source(qualname: str) -> str:
    import importlib

    module, name = qualname.rsplit(".", 1)
    return inspect.getsource(getattr(importlib.import_module(module), name))


def grounded_prompts() -> list[list[dict]]:
    out = []
    for qualname in EDIT_SOURCES:
        src = _source(qualname)
        out.append([{"role": "user", "content": (
            "Here is a Python function:\n```python\n" + src + "```\n"
            "Add a one-line comment above the first line of the body saying what it does, and "
            "otherwise return the whole function unchanged in a python code block.")}])
    return out


def open_prompts(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": OPEN_PROMPTS[i % len(OPEN_PROMPTS)]}] for i in range(n)]


def run_config(llm, prompt_ids: list[list[int]], params: SamplingParams) -> tuple[float, int, dict]:
    # the suffix store would otherwise hold this very output from the previous repetition
    # (and from the other copies of a prompt in "batch"): each run starts with an empty one
    if llm.engine.config.speculative_config is not None:
        llm.engine.executor.control_proposer("reset_history")
    before = dict(llm.get_metrics())
    gc.collect()  # not the garbage of the previous configuration's run
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    after = llm.get_metrics()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    drafts = after["num_drafts"] - before.get("num_drafts", 0)
    accepted = after["num_accepted_tokens"] - before.get("num_accepted_tokens", 0)
    drafted = after["num_draft_tokens"] - before.get("num_draft_tokens", 0)
    return elapsed, tokens, {
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "outputs": [o.outputs[0].token_ids for o in outs],
    }


def bench_workloads(args) -> dict:
    from specdec import LLM
    from specdec.worker.shared_weights import SharedWeights
    from specdec.cli import engine_kwargs

    base_kwargs = engine_kwargs(args)
    base_kwargs.pop("speculative_config", None)
    configs = {"off": None}
    for method in args.methods:
        spec = {"method": method, "num_speculative_tokens": args.k}  # ngram: prompt_lookup 1..4, the defaults
        configs[method] = spec
        configs[f"{method}-auto"] = dict(spec, num_speculative_tokens="auto", max_num_speculative_tokens=args.k)
    configs["off-again"] = None  # the A/A control (short workloads only)
    # one copy of the weights for every engine (none of these proposers has a model of its own):
    # engines with their own copies differ in speed by where each copy's pages landed
    weights = SharedWeights()
    first = LLM(model=args.model, target_weights=weights, **base_kwargs)
    engines = {name: first if spec is None and name == "off" else
               LLM(model=args.model, speculative_config=spec, target_weights=weights, **base_kwargs)
               for name, spec in configs.items()}
    gc.collect()
    workloads = {
        # an edit prints the file back whole: room for the longest function (946 tokens) and a comment
        "grounded": (grounded_prompts(), args.grounded_output_len),
        "open": (open_prompts(4), args.output_len),
        "batch": (open_prompts(args.batch), args.output_len // 2),
    }
    results = {}
    for wname in args.workloads:
        short = wname != "grounded"
        names = [n for n in engines if short or n != "off-again"]
        convs, out_len = workloads[wname]
        ids = [engines["off"].apply_chat_template(c) for c in convs]
        params = SamplingParams(temperature=0, max_tokens=out_len)
        times = {name: [] for name in names}
        extra = {}
        repeats = (args.short_repeats or 3 * args.repeats) if short else args.repeats
        warmup = {name: [] for name in names}
        for r in range(-args.warmup, repeats):  # interleaved A/B/C..., B/C/.../A, ...
            for name in names[r % len(names):] + names[:r % len(names)]:
                llm = engines[name]
                elapsed, tokens, info = run_config(llm, ids, params)
                (times if r >= 0 else warmup)[name].append(tokens / elapsed)
                extra[name] = info
        ref = extra["off"]["outputs"]
        rows = {}
        for name in names:
            tps = statistics.median(times[name])
            same = sum(a == b for a, b in zip(ref, extra[name]["outputs"]))
            # each repetition's run against the plain run of the same repetition (minutes apart
            # at most), then the median: this VM's speed drifts more between repetitions
            ratios = [t / b for t, b in zip(times[name], times["off"])]
            rows[name] = {"tokens_per_s": tps, "speedup": statistics.median(ratios), "speedup_per_repeat": ratios,
                          "warmup_speedups": [t / b for t, b in zip(warmup[name], warmup["off"])],
                          "identical_outputs": f"{same}/{len(ref)}",
                          "acceptance_rate": extra[name]["acceptance_rate"],
                          "mean_acceptance_length": extra[name]["mean_acceptance_length"]}
        results[wname] = {"num_prompts": len(ids), "output_len": out_len, "repeats": repeats, "rows": rows}
    from specdec.bench.report import result_header

    return {**result_header(args, "workloads", None), "model": args.model, "k": args.k, "repeats": args.repeats,
            "workloads": results}


def render(result: dict) -> str:
    """The table (also what BENCHMARKS.md shows for a ``workloads`` result)."""
    from specdec.bench.report import format_table

    rows = [[wname, f"{w['num_prompts']} x {w['output_len']}", name, r["tokens_per_s"], r["speedup"],
             r["acceptance_rate"], r["mean_acceptance_length"], r["identical_outputs"]]
            for wname, w in result["workloads"].items() for name, r in w["rows"].items()]
    headers = ["workload", "prompts x tokens", "config", "tok/s", "speedup vs off", "accept rate", "mean acc len",
               "identical to off"]
    reps = {w.get("repeats", result["repeats"]) for w in result["workloads"].values()}
    return (f"model {result['model']}, K up to {result['k']}, medians of "
            f"{'/'.join(str(r) for r in sorted(reps))} interleaved runs\n\n"
            + format_table(headers, rows))


def cmd_workloads(args) -> int:
    from specdec.bench.report import run_benchmark

    return run_benchmark(args, bench_workloads, render)


def add_workloads_parser(bench_sub) -> None:
    from specdec.cli import add_engine_args

    p = bench_sub.add_parser("workloads", help="n-gram / suffix / auto speculation on grounded, open and batched work")
    add_engine_args(p)
    p.add_argument("--methods", nargs="+", default=["ngram", "suffix"], choices=["ngram", "suffix"])
    p.add_argument("--workloads", nargs="+", default=["grounded", "open", "batch"],
                   choices=["grounded", "open", "batch"])
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--output-len", type=int, default=256, help="open workload answer length (batch: half)")
    p.add_argument("--grounded-output-len", type=int, default=1024,
                   help="grounded workload answer cap: room to print the edited function back whole")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--short-repeats", type=int, default=None,
                   help="repetitions of the short open and batch workloads (default: 3 x --repeats)")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed runs of every configuration before each workload's repetitions (an engine's "
                        "first run at a workload's shapes is slow, by 0.1-0.2x here); their speedups are kept "
                        "in the JSON as warmup_speedups")
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=cmd_workloads)
    return p
