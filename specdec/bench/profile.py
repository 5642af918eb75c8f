"""``specdec bench profile``: where one decode step's time goes.

The engine steps a batch already past its prefill under ``torch.profiler``; the engine marks
the parts of a step with named ranges (``specdec.profiling``): the proposer, the target's
forward, the paged attention inside it (KV write + attend), and verification/sampling. Each
operator is charged to the innermost labelled range around it; inside the target forward
it counts as *linear* (matmul-family operators: weights and the LM head), or *other kernels*
(norms, rotary, activations, embedding, residual adds, indexing). Time inside a range that no
operator accounts for is Python (and dispatcher) work: *forward Python* inside the target's
forward, *engine Python* in the rest of the step (scheduling, batch preparation, commit,
detokenizing). The profiler adds ~1-2 us per operator, charged mostly to the Python rows: the
step time measured without it is printed beside the profiled one. Host (CPU) time only: on a
GPU an operator's time is its launch, and waiting for the device lands on whatever synchronises.
"""
from __future__ import annotations

import time

from specdec.bench import driver
from specdec.bench.cli import add_common_args, engine_args, has_speculation
from specdec.bench.report import format_table, median, result_header, run_benchmark
from specdec.profiling import RANGE_PREFIX

# the matmul-family operators the model's linears reach (packed bf16, int8 variants, plain F.linear)
LINEAR_OPS = frozenset({"aten::linear", "aten::addmm", "aten::mm", "aten::matmul", "aten::bmm",
                        "mkldnn::_linear_pointwise", "aten::_weight_int8pack_mm", "quantized::linear_dynamic"})
LINEAR_OP_PREFIX = "specdec_woq"  # specdec's own: specdec_woq_<isa>::*, specdec_woq_a8_<isa>::a8_linear
CATEGORIES = ("linear", "attention", "other kernels", "forward Python", "draft", "verification + sampling",
              "engine Python")
_PREFIX = RANGE_PREFIX


def add_parser(sub):
    p = sub.add_parser("profile", help="where a decode step's time goes: linear, attention, sampling, Python")
    add_common_args(p, output_len=48)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=24, help="decode steps profiled per engine")
    p.set_defaults(func=run, num_iters=3)
    return p


def run(args) -> int:
    return run_benchmark(args, measure, render, "plot_profile")


def _start_decoding(llm, prompts, params) -> None:
    engine = llm.engine
    ids = [f"profile-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    produced: set[str] = set()
    while len(produced) < len(ids):
        for out in engine.step():
            if out.outputs[0].token_ids:
                produced.add(out.request_id)


def _finish(llm) -> None:
    while llm.engine.has_unfinished_requests():
        llm.engine.step()


def classify(events) -> dict[str, float]:
    """Microseconds per category, summed over every ``specdec::step`` range in ``events``."""
    totals = dict.fromkeys(CATEGORIES, 0.0)
    range_time = {"step": 0.0, "draft": 0.0, "forward": 0.0, "verify": 0.0}
    for e in events:
        name = e.name
        dur = e.time_range.elapsed_us()
        if name.startswith(_PREFIX):
            label = name[len(_PREFIX):]
            if label == "attention":
                if _innermost_label(e) == "forward":
                    totals["attention"] += dur
            elif label in range_time:
                range_time[label] += dur
            continue
        if not _is_operator(name) or _has_operator_ancestor(e):
            continue  # charged through its top-level operator
        if _innermost_label(e) == "forward":
            totals["linear" if name in LINEAR_OPS or name.startswith(LINEAR_OP_PREFIX) else "other kernels"] += dur
    totals["forward Python"] = range_time["forward"] - totals["linear"] - totals["attention"] - totals["other kernels"]
    totals["draft"] = range_time["draft"]
    totals["verification + sampling"] = range_time["verify"]
    # the draft runs inside the step but outside the target's forward
    totals["engine Python"] = range_time["step"] - range_time["draft"] - range_time["forward"] - range_time["verify"]
    return totals


def _innermost_label(event) -> str | None:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(_PREFIX):
            return parent.name[len(_PREFIX):]
        parent = parent.cpu_parent
    return None


def _is_operator(name: str) -> bool:  # aten::, mkldnn::, quantized:: ... but not our labels
    return "::" in name and not name.startswith(_PREFIX)


def _has_operator_ancestor(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if _is_operator(parent.name):
            return True
        parent = parent.cpu_parent
    return False


def profile_engine(llm, prompts, params, steps: int, num_iters: int) -> dict:
    """Step time without the profiler (median of ``num_iters`` runs of ``steps`` decode steps), then
    one profiled run of the same length, split into categories (ms per step)."""
    import torch

    plain_ms = []
    for _ in range(num_iters):
        _start_decoding(llm, prompts, params)
        t0 = time.perf_counter()
        for _ in range(steps):
            llm.engine.step()
        plain_ms.append((time.perf_counter() - t0) * 1e3 / steps)
        _finish(llm)
    _start_decoding(llm, prompts, params)
    emitted = llm.engine.spec_metrics.num_emitted_tokens
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            llm.engine.step()
    tokens_per_step = (llm.engine.spec_metrics.num_emitted_tokens - emitted) / steps
    _finish(llm)
    us = classify(prof.events())
    ms = {k: v / 1e3 / steps for k, v in us.items()}
    profiled = sum(ms.values())
    return {"step_ms": median(plain_ms), "step_ms_per_iter": plain_ms, "profiled_step_ms": profiled,
            "tokens_per_step": tokens_per_step, "breakdown_ms": ms,
            "breakdown_fraction": {k: v / profiled for k, v in ms.items()}}


def measure(args) -> dict:
    from specdec.cli import make_llm

    # long enough that no request finishes inside the profiled steps, whatever K accepts
    from specdec.spec_decode.ngram import MAX_NUM_SPECULATIVE_TOKENS

    max_tokens = args.steps * (MAX_NUM_SPECULATIVE_TOKENS + 1) + 8  # every draft accepted, every step
    need = args.input_len + max_tokens + 16
    params = driver.greedy_params(max_tokens)
    engines = {"no speculation": make_llm(engine_args(args, speculative=False, max_model_len=need))}
    base = engines["no speculation"]
    prompts = driver.make_prompts(base, args.prompts, args.batch_size, args.input_len, seed=args.seed * 7919)
    driver.warmup(base)
    if has_speculation(args):
        spec = make_llm(engine_args(args, max_model_len=need))
        if driver.takes_references(spec):  # replay: the target's own path
            driver.register_references(spec, prompts, driver.timed_generate(base, prompts, params).token_ids)
        driver.warmup(spec)
        engines[f"speculative ({spec.engine.config.speculative_config.method})"] = spec
    profiles = {name: profile_engine(llm, prompts, params, args.steps, args.num_iters)
                for name, llm in engines.items()}
    for name, p in profiles.items():
        print(f"{name}: {p['step_ms']:.2f} ms/step ({p['profiled_step_ms']:.2f} profiled), "
              f"{p['tokens_per_step']:.2f} tokens/step", flush=True)
    result = result_header(args, "profile", None, base.engine.device)
    result.update(
        config={"model": base.engine.model_path, "dtype": str(base.engine.dtype).removeprefix("torch."),
                "batch_size": args.batch_size, "input_len": args.input_len, "steps": args.steps,
                "num_iters": args.num_iters, "prompts": args.prompts},
        engines=profiles,
    )
    return result


def render(result: dict) -> str:
    cfg, engines = result["config"], result["engines"]
    names = list(engines)
    lines = [f"model {cfg['model']} ({cfg['dtype']}), batch {cfg['batch_size']}, context {cfg['input_len']}+, "
             f"{cfg['steps']} decode steps profiled per engine; ms per step (share of the profiled step)"]
    rows = []
    for cat in CATEGORIES:
        rows.append([cat] + [f"{engines[n]['breakdown_ms'][cat]:.2f} ({engines[n]['breakdown_fraction'][cat]:.0%})"
                             for n in names])
    rows.append(["profiled step"] + [f"{engines[n]['profiled_step_ms']:.2f}" for n in names])
    rows.append(["step without profiler"] + [f"{engines[n]['step_ms']:.2f}" for n in names])
    rows.append(["tokens per step"] + [f"{engines[n]['tokens_per_step']:.2f}" for n in names])
    lines.append(format_table(["category"] + names, rows))
    return "\n\n".join(lines)
