"""``specdec bench compare``: specdec vs Hugging Face transformers on the same checkpoint.

Systems (each on the same prompts, one prompt at a time, greedy, EOS ignored):
transformers ``generate``, assisted generation (``assistant_model=``, K fixed), prompt
lookup (``prompt_lookup_num_tokens=``); specdec without speculation, with the same draft
model, and with n-gram lookup. Repetitions visit the systems in turn (A B C ... A B C ...)
and the table reports medians of end-to-end tokens/s (prefill included, as transformers
does not split it) and each system's greedy agreement with transformers ``generate``:
identical in float32; bf16 may differ where two logits tie to rounding.
"""
from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path

import torch

from specdec.bench import driver
from specdec.bench.cli import add_common_args, engine_args
from specdec.bench.report import format_table, median, result_header, run_benchmark
from specdec.bench.roofline import engine_roofline, measure_bandwidth, paired_fraction


def add_parser(sub):
    p = sub.add_parser("compare", help="specdec vs transformers generate / assisted / prompt lookup, same run")
    add_common_args(p, output_len=64)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--draft-model", nargs="+", default=None,
                   help="draft checkpoint(s) for assisted generation and draft_model; a draft with another "
                        "tokenizer than the target runs as a specdec draft_model only")
    p.add_argument("--k", type=int, default=5, help="draft tokens per step (assisted and draft_model, fixed)")
    p.add_argument("--prompt-lookup-num-tokens", type=int, default=10)
    p.add_argument("--systems", nargs="+", default=None, help="subset of systems to run (default: all available)")
    p.set_defaults(func=run, num_iters=3, prompts="text")
    return p


def run(args) -> int:
    return run_benchmark(args, measure, render, "plot_compare")


def _hf_model(path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    # the benchmark ignores EOS like ignore_eos=True: no EOS id, so generation never stops early
    # (min_new_tokens instead would mask the EOS logit and change the greedy choice)
    model.generation_config.eos_token_id = None
    return model


def _hf_runner(model, max_new_tokens: int, **kwargs):
    def generate(prompt: list[int]) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=0, **kwargs)
        return out[0, len(prompt):].tolist()
    return generate


def _specdec_runner(llm, output_len: int, use_speculation: bool = True):
    params = driver.greedy_params(output_len)
    params.use_speculation = use_speculation

    def generate(prompt: list[int]) -> list[int]:
        return driver.timed_generate(llm, [prompt], params).token_ids[0]
    return generate


def build_systems(args):
    """name -> generate(prompt ids) -> output ids; the engines too (the n-gram one: roofline, dtype;
    each speculating system's, for its acceptance). Only the systems ``--systems`` names are loaded."""
    from specdec.cli import make_llm

    lookup = args.prompt_lookup_num_tokens
    ngram = json.dumps({"method": "ngram", "num_speculative_tokens": min(lookup, 16), "prompt_lookup_max": 4})
    # plain decoding reuses the n-gram engine with speculation off per request: one copy of the weights fewer
    ngram_llm = make_llm(engine_args(args, speculative=True, speculative_config=ngram, speculative_model=None,
                                     no_speculation=False))
    dtype = ngram_llm.engine.dtype

    def specdec_llm(config: dict):
        return make_llm(engine_args(args, speculative=True, speculative_config=json.dumps(config),
                                    speculative_model=None, no_speculation=False))

    hf = []  # the transformers target, loaded on first use

    def hf_runner(**kwargs):
        if not hf:
            hf.append(_hf_model(ngram_llm.engine.model_path, dtype))
        return _hf_runner(hf[0], args.output_len, **kwargs), None

    ngram_name = f"specdec ngram K={min(lookup, 16)}"
    builders = {  # name -> () -> (generate, the engine whose metrics it reports, or None)
        "transformers generate": hf_runner,
        f"transformers prompt lookup {lookup}": lambda: hf_runner(prompt_lookup_num_tokens=lookup),
        "specdec": lambda: (_specdec_runner(ngram_llm, args.output_len, use_speculation=False), None),
        ngram_name: lambda: (_specdec_runner(ngram_llm, args.output_len), ngram_llm),
    }
    for n, draft_path in enumerate(args.draft_model or []):
        config = {"method": "draft_model", "model": draft_path, "num_speculative_tokens": args.k}
        tag = f" ({Path(draft_path).name})" if len(args.draft_model) > 1 else ""

        def speculating(config=config):
            llm = specdec_llm(config)
            return _specdec_runner(llm, args.output_len), llm

        builders[f"specdec draft_model K={args.k}{tag}"] = speculating
        if n or not _same_tokenizer(ngram_llm, draft_path):  # transformers' assisted generation: one shared vocabulary
            continue
        builders[f"transformers assisted K={args.k}"] = lambda draft_path=draft_path: hf_runner(
            assistant_model=_hf_model(draft_path, dtype), num_assistant_tokens=args.k,
            num_assistant_tokens_schedule="constant")
        if ngram_llm.engine.device.type == "cpu":  # the draft's bytes cap the speedup
            builders[f"specdec draft_model K={args.k} int8 draft"] = partial(
                speculating, dict(config, quantization="int8_dynamic"))
    if args.systems:
        unknown = [s for s in args.systems if s not in builders]
        if unknown:
            raise ValueError(f"--systems: unknown {unknown}; available: {sorted(builders)}")
    systems, engines = {}, {}
    for name, build in builders.items():
        if not args.systems or name in args.systems:
            systems[name], engine = build()
            if engine is not None:
                engines[name] = engine
    return systems, ngram_llm, engines


def _same_tokenizer(llm, draft_path: str) -> bool:
    from specdec.engine.builder import load_tokenizer
    from specdec.models.loader import resolve_model_path

    return load_tokenizer(resolve_model_path(draft_path)).get_vocab() == llm.tokenizer.get_vocab()


def measure(args) -> dict:
    if args.num_prompts < 1 or args.num_iters < 1:
        raise ValueError("--num-prompts and --num-iters must be >= 1")
    if args.temperature != 0:
        raise ValueError("compare checks greedy agreement: --temperature must be 0")
    systems, llm, engines = build_systems(args)
    prompts = driver.make_prompts(llm, args.prompts, args.num_prompts, args.input_len, seed=args.seed * 7919)
    warm = prompts[0][: max(1, args.input_len // 4)]
    for fn in systems.values():  # warm-up: first-call allocations, oneDNN primitive caches
        fn(warm)
    rates: dict[str, list[float]] = {name: [] for name in systems}
    outputs: dict[str, list[list[int]]] = {}
    bandwidths = []
    for rep in range(args.num_iters):
        bandwidths.append(measure_bandwidth(args.bandwidth_mib << 20, repeats=3, device=llm.engine.device))
        for name, fn in systems.items():
            t = time.perf_counter()
            outs = [fn(p) for p in prompts]
            elapsed = time.perf_counter() - t
            rates[name].append(sum(len(o) for o in outs) / elapsed)
            outputs.setdefault(name, outs)
        print(f"iteration {rep + 1}/{args.num_iters}: " +
              ", ".join(f"{n} {r[-1]:.2f}" for n, r in rates.items()), flush=True)
    reference_name = "transformers generate" if "transformers generate" in outputs else next(iter(outputs))
    reference = outputs[reference_name]
    bandwidth = median(bandwidths)
    roof = engine_roofline(llm, bandwidth, args.input_len + args.output_len / 2, 1)
    rows = []
    for name in systems:
        tps = median(rates[name])
        rows.append({"system": name, "tokens_per_s": tps, "tokens_per_s_per_iter": rates[name],
                     "roofline_fraction": paired_fraction(rates[name], bandwidths, roof),
                     "agreement_with_reference": driver.agreement(reference, outputs[name]),
                     # drafts per step accepted + 1, over the whole run (warm-up included)
                     "mean_acceptance_length": engines[name].get_metrics().get("mean_acceptance_length")
                     if name in engines else None})
    if "specdec" in outputs:  # speculation must not change what the engine itself decodes
        for r in rows:
            r["agreement_with_specdec"] = driver.agreement(outputs["specdec"], outputs[r["system"]])
    base = next((r["tokens_per_s"] for r in rows if r["system"] == reference_name), None)
    for r in rows:
        r["speedup_vs_reference"] = r["tokens_per_s"] / base if base else None
    result = result_header(args, "compare", bandwidth, llm.engine.device)
    result.update(
        config={"model": llm.engine.model_path, "draft_model": args.draft_model,
                "dtype": str(llm.engine.dtype).removeprefix("torch."), "num_prompts": args.num_prompts,
                "input_len": args.input_len, "output_len": args.output_len, "num_iters": args.num_iters,
                "prompts": args.prompts, "k": args.k, "prompt_lookup_num_tokens": args.prompt_lookup_num_tokens,
                "reference": reference_name,
                "note": "end-to-end tokens/s incl. prefill, batch 1; 'specdec' is the n-gram engine with "
                        "use_speculation=False per request"},
        roofline={**roof.as_dict(), "bandwidth_gb_per_s_per_iter": [b / 1e9 for b in bandwidths]},
        rows=rows,
    )
    return result


def render(result: dict) -> str:
    cfg, roof = result["config"], result["roofline"]
    lines = [f"model {cfg['model']} ({cfg['dtype']}), {cfg['num_prompts']} prompts x {cfg['output_len']} tokens, "
             f"{cfg['num_iters']} iterations (medians); roofline {roof['tokens_per_s']:.2f} tok/s at "
             f"{roof['bandwidth_gb_per_s']:.1f} GB/s"]
    headers = ["system", "tok/s (e2e)", "vs transformers", "roofline frac", "identical outputs", "prefix agreement",
               "identical to specdec plain", "mean acc. length"]
    rows = [[r["system"], r["tokens_per_s"], r["speedup_vs_reference"], r["roofline_fraction"],
             r["agreement_with_reference"]["identical_fraction"],
             r["agreement_with_reference"]["mean_prefix_agreement"],
             (r.get("agreement_with_specdec") or {}).get("identical_fraction"), r.get("mean_acceptance_length")]
            for r in result["rows"]]
    lines.append(format_table(headers, rows))
    return "\n\n".join(lines)
