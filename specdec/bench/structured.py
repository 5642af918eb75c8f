"""``specdec bench structured``: speculation with a grammar against speculation without one.

Workloads: ``extract`` pulls a record out of a given text as JSON under a strict schema (the
texts and the schema below); ``tools`` asks for a tool call with ``tool_choice="required"``
(the model's Hermes-style ``<tool_call>`` format, name and arguments enforced by the tool
grammar). Four configurations per workload and batch size, on one copy of the target
weights, interleaved over repetitions: no speculation / speculation, each unconstrained and
constrained. Reported: tokens/s, the speedup of speculation in each mode, the grammar's share
of the constrained runs' time (matchers, masks on drafts and verification rows), the tokens
the grammar forced, and whether every constrained output parsed and validated.
"""
from __future__ import annotations

import gc
import json
import statistics
import time

from specdec.sampling_params import SamplingParams
from specdec.structured_output import StructuredOutputsParams

TEXTS = (
    "Maria Lopez, 34, moved from Seville to Berlin last spring and now works as a nurse.",
    "Our new hire is Kenji Watanabe (age 28), a backend engineer based in Osaka.",
    "At 61, retired teacher Ahmed Hassan still volunteers every weekend in Cairo.",
    "Léa Martin is a 45-year-old architect who lives in Lyon with her two children.",
    "Tom O'Brien, a 19 year old student from Dublin, plays guitar in a small band.",
    "The winner, Priya Raman, is a 52-year-old chemist from Chennai.",
    "Lukas Novak (age 37) drives a tram in Prague and collects old maps.",
    "Sofia Rossi, pastry chef, aged 29, opened her first bakery in Turin.",
)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string"},
        "occupation": {"type": "string"},
    },
    "required": ["name", "age", "city", "occupation"],
    "additionalProperties": False,
}


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
     "parameters": {"type": "object", "properties": {
         "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
         "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                    "required": ["city"], "additionalProperties": False}}},
]
TOOL_QUESTIONS = ("What's the weather like in Lisbon right now?", "What time is it in Tokyo?",
                  "Is it cold in Oslo today, in fahrenheit?", "Tell me the local time in Lima.")


def tool_prompts(n: int) -> list[list[dict]]:
    listing = "\n".join(json.dumps(t["function"]) for t in TOOLS)
    system = ("You can call these tools. To call one, answer only with <tool_call>\n{\"name\": ..., "
              "\"arguments\": {...}}\n</tool_call>.\n" + listing)
    return [[{"role": "system", "content": system}, {"role": "user", "content": TOOL_QUESTIONS[i % len(TOOL_QUESTIONS)]}]
            for i in range(n)]


def tool_grammar() -> StructuredOutputsParams:
    from specdec.tool_parsers import get_tool_parser, tool_call_grammar

    return tool_call_grammar(get_tool_parser("hermes"), [t["function"] for t in TOOLS], parallel=False)


def extract_prompts(n: int) -> list[list[dict]]:
    return [[{"role": "system", "content": "You extract facts as JSON with the keys name, age, city and occupation."},
             {"role": "user", "content": TEXTS[i % len(TEXTS)]}] for i in range(n)]


def _run(llm, prompt_ids, params, batch: int) -> dict:
    before = dict(llm.get_metrics())
    gc.collect()
    outs, t = [], time.perf_counter()
    for first in range(0, len(prompt_ids), batch):
        outs += llm.generate([{"prompt_token_ids": p} for p in prompt_ids[first:first + batch]], params,
                             use_tqdm=False)
    elapsed = time.perf_counter() - t
    after = llm.get_metrics()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in ("num_drafts", "num_accepted_tokens",
                                                             "time_grammar_s", "num_forced_tokens")}
    return {"elapsed": elapsed, "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "texts": [o.outputs[0].text for o in outs], **delta}


def bench_structured(args) -> dict:
    from specdec import LLM
    from specdec.worker.shared_weights import SharedWeights
    from specdec.cli import engine_kwargs

    kw = engine_kwargs(args)
    spec_kw = {k: v for k, v in kw.items() if k != "speculative_config"}
    weights = SharedWeights()
    off = LLM(model=args.model, target_weights=weights, **dict(spec_kw, speculative_config=None))
    spec = LLM(model=args.model, target_weights=weights, **kw)
    engines = {"off": off, "spec": spec}
    results = {}
    for wname, batch in ((w, b) for w in args.workloads for b in args.batch_sizes):
        if wname == "extract":
            grammar, make_prompts = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), extract_prompts
        else:
            grammar, make_prompts = tool_grammar(), tool_prompts
        modes = {"free": SamplingParams(temperature=0, max_tokens=args.output_len),
                 "json": SamplingParams(temperature=0, max_tokens=args.output_len, structured_outputs=grammar)}
        ids = [off.apply_chat_template(c) for c in make_prompts(max(batch, args.num_prompts))]
        names = [(e, m) for m in modes for e in engines]
        runs: dict = {n: [] for n in names}
        for r in range(-args.warmup, args.repeats):
            for name in names[r % len(names):] + names[:r % len(names)]:
                result = _run(engines[name[0]], ids, modes[name[1]], batch)
                if r >= 0:
                    runs[name].append(result)
        rows = {}
        for (e, m), rs in runs.items():
            tps = [x["tokens"] / x["elapsed"] for x in rs]
            base = [x["tokens"] / x["elapsed"] for x in runs[("off", m)]]
            valid = None
            if m == "json":
                valid = sum(_valid(t, wname) for t in rs[-1]["texts"])
            drafts = rs[-1]["num_drafts"]
            rows[f"{e}/{m}"] = {
                "tokens_per_s": statistics.median(tps),
                "speedup_vs_off": statistics.median(a / b for a, b in zip(tps, base)),
                "grammar_share": statistics.median(x["time_grammar_s"] / x["elapsed"] for x in rs),
                "forced_tokens": rs[-1]["num_forced_tokens"], "tokens": rs[-1]["tokens"],
                "mean_acceptance_length": 1 + rs[-1]["num_accepted_tokens"] / drafts if drafts else None,
                "valid_output": None if valid is None else f"{valid}/{len(rs[-1]['texts'])}",
                "identical_to_off": rs[-1]["texts"] == runs[("off", m)][-1]["texts"],
            }
        results[f"{wname}/{batch}"] = {"workload": wname, "batch": batch, "num_prompts": len(ids), "rows": rows}
    from specdec.bench.report import result_header

    return {**result_header(args, "structured", None), "model": args.model, "repeats": args.repeats,
            "output_len": args.output_len, "batches": results}


def _valid(text: str, workload: str) -> bool:
    if workload == "tools":
        from specdec.tool_parsers import get_tool_parser

        calls = get_tool_parser("hermes").parse(text).tool_calls
        return len(calls) == 1 and calls[0].name in {t["function"]["name"] for t in TOOLS} and \
            isinstance(json.loads(calls[0].arguments), dict)
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return set(value) == set(SCHEMA["required"]) and isinstance(value["age"], int) and 0 <= value["age"] <= 130


def render(result: dict) -> str:
    from specdec.bench.report import format_table

    rows = [[w["workload"], w["batch"], f"{w['num_prompts']}", name, r["tokens_per_s"], r["speedup_vs_off"], r["grammar_share"],
             r["forced_tokens"], r["mean_acceptance_length"], r["valid_output"], r["identical_to_off"]]
            for w in result["batches"].values() for name, r in w["rows"].items()]
    headers = ["workload", "batch", "prompts", "config/mode", "tok/s", "speedup vs off", "grammar share of time",
               "forced tokens", "mean acc len", "valid output", "same as off"]
    return (f"model {result['model'] or 'default pair'}, {result['output_len']} tokens max, "
            f"medians of {result['repeats']} interleaved runs\n\n" + format_table(headers, rows))


def cmd_structured(args) -> int:
    from specdec.bench.report import run_benchmark

    return run_benchmark(args, bench_structured, render)


def add_structured_parser(bench_sub):
    from specdec.cli import add_engine_args

    p = bench_sub.add_parser("structured", help="speculation with a grammar vs without (JSON extraction, tool calls)")
    add_engine_args(p)
    p.add_argument("--workloads", nargs="+", default=["extract", "tools"], choices=["extract", "tools"])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per run (at least the batch size)")
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=cmd_structured)
    return p
