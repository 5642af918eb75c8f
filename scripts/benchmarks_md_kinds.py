"""What BENCHMARKS.md shows of each result kind (the ``kind`` a ``bench_results/*.json`` records):
a title, one headline line, and the rows it adds to its machine kind's summary table.

One renderer per kind, registered in ``RENDERERS``: a new kind is a headline function, optionally a
summary function, and one registry line. A summary row is ``[measure, value, detail, source]``;
every number in it is read from the JSON. Results written before ``kind`` was recorded are
recognised by their shape (``UNTAGGED``).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Callable

from specdec.bench.peers.configs import LLAMA_CPP, REFERENCE, SPECDEC
from specdec.bench.peers.goals import find, paired_ratio

SURVEY_ROWS = 7  # a K=6 verification: the row count the kernel survey's t(M)/t(1) is quoted at


def num(value, spec: str = ".2f") -> str:
    if value is None or value != value:  # None or nan
        return "-"
    return format(value, spec)


def _gbs(value) -> str:
    """GB/s with one decimal, or two significant digits below 1 (a kernel far from the bandwidth)."""
    return num(value, ".2g" if value is not None and value < 1 else ".1f")


def _row(measure: str, value: str, detail: str, name: str) -> list[str]:
    return [measure, value, detail, f"`{name}`"]


def _no_summary(name: str, data: dict) -> list[list[str]]:
    return []


# ---- latency, profile, throughput, sweep: the engine benchmarks ---------------------------------

def latency_headline(data: dict) -> str:
    spec = data.get("speculative") or {}
    text = (f"plain {num(data['baseline']['decode_tokens_per_s'], '.1f')} tok/s = "
            f"{num(data.get('roofline_fraction'))} of roofline")
    if spec:
        text += (f"; {spec.get('method')} K={spec.get('k')}: {num(spec.get('speedup'))}x, "
                 f"efficiency {num(spec.get('efficiency'))}")
    return text


def latency_summary(name: str, data: dict) -> list[list[str]]:
    cfg = data.get("config") or {}
    if cfg.get("batch_size") != 1 or data.get("roofline_fraction") is None:
        return []
    model = os.path.basename(str(cfg.get("model")))
    return [_row(f"plain decoding / roofline, dtype={cfg.get('dtype')}, batch 1", num(data["roofline_fraction"]),
                 f"{num(data['baseline']['decode_tokens_per_s'], '.1f')} tok/s, {model}", name)]


def profile_headline(data: dict) -> str:
    return "; ".join(f"{engine}: {num(p['step_ms'], '.1f')} ms/step, "
                     f"linears {num(p['breakdown_fraction']['linear'], '.0%')}"
                     for engine, p in data["engines"].items())


def throughput_headline(data: dict) -> str:
    return "; ".join(f"batch {r['batch_size']}: {num(r['baseline']['decode_tokens_per_s'], '.0f')} tok/s "
                     f"({num(r.get('roofline_fraction'))} roofline)" for r in data["rows"])


def sweep_headline(data: dict) -> str:
    eff = sorted(c["engine_efficiency"] for c in data["cells"] if c.get("engine_efficiency") is not None)
    return f"{len(data['cells'])} cells; engine efficiency median {num(eff[len(eff) // 2])}, worst {num(eff[0])}"


def roofline_headline(data: dict) -> str:
    return "; ".join(f'dtype="{e["dtype"]}": {num(e["decode_tokens_per_s"], ".1f")} tok/s = '
                     f'{num(e.get("roofline_fraction"))} of roofline' for e in data["engines"])


def roofline_summary(name: str, data: dict) -> list[list[str]]:
    threads = (data.get("machine") or {}).get("torch_threads")
    rows = []
    for e in data["engines"]:
        bound = (e.get("roofline") or {}).get("attainable_tokens_per_s")
        rows.append(_row(f'dtype="{e["dtype"]}" decoding / roofline, batch 1', num(e.get("roofline_fraction")),
                         f'{num(e["decode_tokens_per_s"], ".1f")} of {num(bound, ".1f")} tok/s, engine dtype '
                         f'{e.get("engine_dtype")}, {threads} thread(s)', name))
    return rows


def step_overhead_headline(data: dict) -> str:
    return "CPU us per step outside the forward, base -> new: " + ", ".join(
        f"{s['method']} b{s['batch']} {num(s['base_outside_cpu_us'], '.0f')}->{num(s['new_outside_cpu_us'], '.0f')}"
        for s in data["entries"])


# ---- speculation policy: "auto" K against fixed K ---------------------------------------------------

def autok_headline(data: dict) -> str:
    text = f"auto / best fixed K {num(data.get('auto_over_best_fixed'), '.3f')}"
    if data.get("auto_over_held_out_k") is not None:
        text += f", / held-out K {num(data['auto_over_held_out_k'], '.3f')}"
    return text


def autok_summary(name: str, data: dict) -> list[list[str]]:
    cfg = data.get("config") or {}
    ks = ",".join(p for p in data.get("policies", []) if p != "auto")
    detail = f"K = {ks}; {cfg.get('num_prompts')} {cfg.get('prompts')} prompts x {cfg.get('output_len')} tokens"
    rows = [_row('"auto" K / best fixed K', num(data.get("auto_over_best_fixed"), ".3f"), detail, name)]
    if data.get("auto_over_held_out_k") is not None:
        rows.append(_row('"auto" K / fixed K chosen on held-out prompts', num(data["auto_over_held_out_k"], ".3f"),
                         detail, name))
    return rows


def auto_vs_fixed_k_headline(data: dict) -> str:
    return f"auto / best fixed K {num(data.get('auto_over_best_fixed_median'), '.3f')} (median of per-round ratios)"


def auto_vs_fixed_k_summary(name: str, data: dict) -> list[list[str]]:
    return [_row('"auto" K / best fixed K', num(data.get("auto_over_best_fixed_median"), ".3f"),
                 "fixed " + ", ".join(k for k in data.get("engines", {}) if k.startswith("K=")), name)]


def _moe_auto_runs(data: dict):
    for run in data["runs"]:
        tps = run["tokens_per_s"]
        fixed = {k: v for k, v in tps.items() if k not in ("plain", "auto")}
        best = max(fixed, key=fixed.get)
        yield run, best, tps["auto"] / fixed[best], run["over_plain"]


def moe_auto_headline(data: dict) -> str:
    return "; ".join(f"a={run['acceptance']} batch {run['batch']}: auto {num(run['over_plain']['auto'])}x plain, "
                     f"K={best} {num(over[best])}x" for run, best, _, over in _moe_auto_runs(data))


def moe_auto_summary(name: str, data: dict) -> list[list[str]]:
    model = os.path.basename(str(data.get("model")))
    return [_row(f'"auto" K / best fixed K, MoE, acceptance {run["acceptance"]}, batch {run["batch"]}',
                 num(ratio, ".3f"), f"best fixed K={best}; {data.get('quantization')} {model}", name)
            for run, best, ratio, _ in _moe_auto_runs(data)]


# ---- peers: specdec against llama.cpp and vLLM -----------------------------------------------------

def _reference(rows: list[dict]) -> dict | None:
    """llama.cpp's plain decoding of the same file: the server row, else llama-bench's."""
    return find(rows, *REFERENCE) or find(rows, LLAMA_CPP, f"{REFERENCE[1]} (llama-bench tg128)")


def _best_specdec(rows: list[dict], ref: dict) -> tuple[dict, float] | None:
    scored = [(r, paired_ratio(r, ref)) for r in rows if r["engine"] == SPECDEC and r.get("median")]
    scored = [(r, x) for r, x in scored if x is not None]
    return max(scored, key=lambda item: item[1], default=None)


def peers_headline(data: dict) -> str:
    rows = data.get("rows", [])
    ref = _reference(rows)
    best = _best_specdec(rows, ref) if ref else None
    text = f"{len(rows) + len(data.get('batch_rows', []))} configurations; table below"
    if best:
        text = f"best specdec {num(best[1])}x llama.cpp {ref['config']}: {best[0]['config']}; " + text
    return text


def peers_summary(name: str, data: dict) -> list[list[str]]:
    rows, out = data.get("rows", []), []
    ref = _reference(rows)
    best = _best_specdec(rows, ref) if ref else None
    if best:
        r, ratio = best
        out.append(_row("best lossless specdec / llama.cpp Q4_K_M plain, batch 1", f"{num(ratio)}x",
                        f"{r['config']} {num(r['median'], '.1f')} vs {ref['config']} {num(ref['median'], '.1f')} tok/s",
                        name))
        for peer in (p for p in rows if p["engine"] == LLAMA_CPP and p.get("speculative") and p.get("median")):
            out.append(_row(f"best lossless specdec / llama.cpp {peer['config']}", f"{num(paired_ratio(r, peer))}x",
                            f"{num(peer['median'], '.1f')} tok/s", name))
    ours, theirs = find(rows, SPECDEC, "bf16 plain"), find(rows, LLAMA_CPP, "bf16 plain")
    if ours and theirs:
        out.append(_row("specdec bf16 plain / llama.cpp bf16 plain, batch 1", f"{num(paired_ratio(ours, theirs))}x",
                        f"{num(ours['median'], '.1f')} vs {num(theirs['median'], '.1f')} tok/s", name))
    return out


def moe_gguf_peer_headline(data: dict) -> str:
    moe = data["moe_verification"]["v"]
    return (f"specdec {data['quantization']} plain {num(data['specdec_over_llama_cpp'])}x llama.cpp; "
            f"v(K=7) MoE {num(moe.get('7'))}, dense {num(data['dense_1p5b_verification']['v'].get('7'))}")


def moe_gguf_peer_summary(name: str, data: dict) -> list[list[str]]:
    spec = [r["specdec_tps"] for r in data["rounds"]]
    peer = [r["llama_cpp_tps"] for r in data["rounds"]]
    moe, dense = data["moe_verification"], data["dense_1p5b_verification"]
    experts = moe.get("experts_per_layer") or {}
    return [_row(f"MoE GGUF plain specdec ({data['quantization']}) / llama.cpp plain (llama-bench), batch 1",
                 f"{num(data['specdec_over_llama_cpp'])}x",
                 f"{os.path.basename(data['gguf'])}: {num(sum(spec) / len(spec), '.1f')} vs "
                 f"{num(sum(peer) / len(peer), '.1f')} tok/s, {data['threads']} threads", name),
            _row("verification v(K=7) = t(8 rows) / t(1 row), MoE / dense 1.5B", f"{num(moe['v'].get('7'))} / "
                 f"{num(dense['v'].get('7'))}", f"distinct experts per layer {num(experts.get('1'), '.1f')} (1 row) .. "
                 f"{num(experts.get('8'), '.1f')} (8 rows)", name)]


def serve_peers_headline(data: dict) -> str:
    same = data.get("greedy_identical") or {}
    return ("; ".join(f"{r['engine']} {num(r['tokens_per_s'], '.1f')} tok/s, {r.get('passed')}/{r['requests']} passed"
                      for r in data["rows"]) + f"; greedy identical {same.get('same')}/{same.get('of')}")


def serve_peers_summary(name: str, data: dict) -> list[list[str]]:
    cfg = data.get("config") or {}
    same = data.get("greedy_identical") or {}
    detail = (f"{cfg.get('num_tasks')} {cfg.get('tasks')} coding tasks x {cfg.get('max_tokens')} tokens, "
              f"{os.path.basename(str(cfg.get('gguf')))}; greedy identical {same.get('same')}/{same.get('of')}")
    return [_row("server workload: specdec (speculative) / llama-server, same GGUF",
                 f"{num(data.get('specdec_x_llama_server'))}x", detail, name),
            _row("server workload: specdec plain / llama-server", f"{num(data.get('plain_x_llama_server'))}x",
                 detail, name)]


# ---- kernels: the survey of row counts ---------------------------------------------------------------

def _survey_rows(rows: list[int]) -> int:
    """The row count quoted: SURVEY_ROWS when measured, else the nearest measured count."""
    return min(rows, key=lambda m: (abs(m - SURVEY_ROWS), m))


def _combined(results: list[dict], m: int) -> tuple[float, float]:
    """One kernel's shapes as one layer: (bytes over time at M=1 in GB/s, t(m)/t(1) of the summed times).
    A shape's bytes are taken as N*K (its format's bytes per weight cancel within one kernel)."""
    size = [r["n"] * r["k"] for r in results]
    gbs1 = [(r.get("gb_per_s") or {}).get("1") or r["ratio"]["1"] * r["copy_gbs"] for r in results]
    t1 = [s / g for s, g in zip(size, gbs1)]
    tm = [t * r["time_vs_m1"][str(m)] for t, r in zip(t1, results)]
    return sum(size) / sum(t1), sum(tm) / sum(t1)


def quant_kernels_headline(data: dict) -> str:
    return f"{len(data['results'])} kernel x shape rows, effective GB/s and t(M)/t(1) per row count"


def quant_kernels_summary(name: str, data: dict) -> list[list[str]]:
    by_kernel: dict[str, list[dict]] = {}
    for r in data["results"]:
        if "error" not in r:
            by_kernel.setdefault(r["kernel"], []).append(r)
    out = []
    for kernel, results in by_kernel.items():  # a merged result's kernels may have measured other row counts
        m = _survey_rows(sorted(set.intersection(*(set(map(int, r["time_vs_m1"])) for r in results))))
        gbs, tm = _combined(results, m)
        copy = sum(r["copy_gbs"] for r in results) / len(results)
        out.append(_row(f"kernel survey: {kernel}", f"{_gbs(gbs)} GB/s; t({m})/t(1) {num(tm)}",
                        f"{len(results)} shapes as one layer, copy {num(copy, '.1f')} GB/s, activations "
                        f"{data['dtype']}, int4 group {data['group_size']}, {data['num_threads']} thread(s)", name))
    return out


def cpu_verify_rows_headline(data: dict) -> str:
    return "t(7)/t(1) of the kernel the engine runs: " + ", ".join(
        f"{fmt} {num(kernels['engine choice']['t_over_t1'].get('7'))}"
        for fmt, kernels in data["results"].items() if "engine choice" in kernels)


def cpu_verify_rows_summary(name: str, data: dict) -> list[list[str]]:
    m = _survey_rows(data["rows"])
    threads = (data.get("machine") or {}).get("torch_threads")
    out = []
    for fmt, kernels in data["results"].items():
        copy = kernels.get("copy_gb_per_s")
        for kernel, r in kernels.items():
            if isinstance(r, dict) and "t_over_t1" in r:
                value = f"{_gbs(r.get('gb_per_s_m1'))} GB/s; t({m})/t(1) {num(r['t_over_t1'].get(str(m)))}"
                out.append(_row(f"layer survey: {fmt} {kernel}", value,
                                f"one layer's linears, copy {num(copy, '.1f')} GB/s, {threads} thread(s)", name))
    return out


def quant_e2e_headline(data: dict) -> str:
    return "; ".join(f"{cfg}: plain {num(r['plain_decode_tok_s'], '.1f')} tok/s, speculative "
                     f"{num(r.get('spec_vs_int4_plain'))}x int4 plain" for cfg, r in data["by_config"].items())


# ---- comparisons, workloads, structured output, drafts, serving, GPU ----------------------------------

def compare_headline(data: dict) -> str:
    return "; ".join(f"{r['system']}: {num(r['tokens_per_s'], '.1f')} tok/s" for r in data["rows"][:4])


def workloads_headline(data: dict) -> str:
    return "; ".join(f"{w}/{name} {num(r.get('speedup'))}x" for w, wd in data["workloads"].items()
                     for name, r in wd["rows"].items() if name in ("ngram", "ngram-auto"))


def structured_headline(data: dict) -> str:
    return "; ".join(f"{key}: with the grammar {num(w['rows']['spec/json']['speedup_vs_off'])}x, grammar "
                     f"{num(w['rows']['spec/json']['grammar_share'], '.1%')} of the step"
                     for key, w in data["batches"].items())


def draft_eval_headline(data: dict) -> str:
    return (f"{data.get('target')}: mean acceptance length {num(data['mean_acceptance_length'])}, "
            f"speedup {num(data['speedup'])}x, identical outputs {data.get('identical_outputs')}")


def acceptance_by_k_headline(data: dict) -> str:
    return "mean acceptance length " + ", ".join(f"K={k} {num(r['mean_acceptance_length'])}"
                                                 for k, r in data["by_k"].items())


def serve_headline(data: dict) -> str:
    return "; ".join(f"{r['server']} at concurrency {r['concurrency']}: {num(r['output_throughput'])} output "
                     f"tok/s, acceptance {num(r.get('acceptance_rate'))}" for r in data["runs"])


def gpu_check_headline(data: dict) -> str:
    return f"{data.get('gpu')}: roofline {num(data.get('roofline_decode_tok_s'), '.0f')} tok/s; see the GPU table below"


@dataclass(frozen=True)
class KindRenderer:
    title: str                                                    # what the result measures (before ":")
    headline: Callable[[dict], str]                               # one line of what it measured
    summary: Callable[[str, dict], list[list[str]]] = _no_summary  # its machine kind's summary rows


RENDERERS: dict[str, KindRenderer] = {
    "peers": KindRenderer("specdec vs vLLM CPU and llama.cpp (each configuration in its own process, interleaved "
                          "rounds)", peers_headline, peers_summary),
    "serve-peers": KindRenderer("The server workload: coding tasks through specdec's server and llama-server (same "
                                "GGUF), requests alternated", serve_peers_headline, serve_peers_summary),
    "moe_gguf_peer": KindRenderer("MoE GGUF against llama.cpp: plain decoding and the verification cost of K+1 rows",
                                  moe_gguf_peer_headline, moe_gguf_peer_summary),
    "latency": KindRenderer("Latency: decode tokens/s vs the roofline, speculation vs none", latency_headline,
                            latency_summary),
    "roofline": KindRenderer("Roofline per dtype: batch-1 decoding over the copy-bandwidth bound", roofline_headline,
                             roofline_summary),
    "profile": KindRenderer("Profile of one decode step: where the time goes", profile_headline),
    "step_overhead": KindRenderer("Per-step overhead: CPU time outside the forward, two revisions compared",
                                  step_overhead_headline),
    "throughput": KindRenderer("Throughput: tokens/s vs batch size", throughput_headline),
    "sweep": KindRenderer("Controlled acceptance (replay): efficiency over acceptance x K", sweep_headline),
    "autok": KindRenderer('"auto" K against each fixed K (one engine, policies alternating per prompt)',
                          autok_headline, autok_summary),
    "auto_vs_fixed_k": KindRenderer('"auto" K against fixed K (scripts/auto_vs_fixed_k.py)', auto_vs_fixed_k_headline,
                                    auto_vs_fixed_k_summary),
    "moe_auto": KindRenderer('"auto" K on a MoE target: verification cost and speedup per policy', moe_auto_headline,
                             moe_auto_summary),
    "compare": KindRenderer("specdec vs Hugging Face transformers and other drafts (same checkpoint, prompts, run)",
                            compare_headline),
    "workloads": KindRenderer("Draft-free speculation on grounded, open-ended and batched work", workloads_headline),
    "structured": KindRenderer("Structured output: speculation with and without a grammar (JSON extraction, tool "
                               "calls)", structured_headline),
    "draft_eval": KindRenderer("Draft evaluation: acceptance and speedup of a draft pair", draft_eval_headline),
    "acceptance_by_k": KindRenderer("Acceptance by K: mean acceptance length per number of drafts",
                                    acceptance_by_k_headline),
    "quant_kernels": KindRenderer("Kernel survey: CPU linear kernels against the copy bandwidth per row count",
                                  quant_kernels_headline, quant_kernels_summary),
    "cpu_verify_rows": KindRenderer("Verification rows on the CPU: t(M)/t(1) of a layer's linears per weight format "
                                    "and kernel", cpu_verify_rows_headline, cpu_verify_rows_summary),
    "quant_e2e": KindRenderer("float32 vs int8 vs int4 weights end to end (single thread)", quant_e2e_headline),
    "serve": KindRenderer("HTTP serving load test", serve_headline),
    "gpu_check": KindRenderer("GPU check (scripts/gpu_check.sh, random-weight Llama-3-8B shape, bf16)",
                              gpu_check_headline),
}

# results that record no "kind": recognised by their shape, first match wins
UNTAGGED: tuple[tuple[str, Callable[[object], bool]], ...] = (
    ("step_overhead", lambda d: isinstance(d, list) and bool(d) and all("base_outside_us" in e for e in d)),
    ("moe_gguf_peer", lambda d: isinstance(d, dict) and "specdec_over_llama_cpp" in d),
    ("moe_auto", lambda d: isinstance(d, dict) and "verification_cost" in d and "runs" in d),
    ("serve", lambda d: isinstance(d, dict) and "runs" in d),
    ("acceptance_by_k", lambda d: isinstance(d, dict) and "by_k" in d),
    ("draft_eval", lambda d: isinstance(d, dict) and {"mean_acceptance_length", "speedup", "target"} <= d.keys()),
)


def normalise(raw) -> dict:
    """A loaded result as a dict with a ``kind`` (a bare list becomes ``{"entries": [...]}``)."""
    data = raw if isinstance(raw, dict) else {"entries": raw}
    if "kind" not in data:
        data["kind"] = next((kind for kind, matches in UNTAGGED if matches(raw)), "other")
    return data


def title(kind: str) -> str:
    return RENDERERS[kind].title if kind in RENDERERS else kind


def _rendered(name: str, data: dict, part: str, fallback):
    """A renderer's part for one result; a result it cannot read is named on stderr, not fatal, so a
    new JSON of another shape never stops the page from being built."""
    renderer = RENDERERS.get(data.get("kind"))
    if renderer is None:
        return fallback
    try:
        return getattr(renderer, part)(name, data) if part == "summary" else renderer.headline(data)
    except (KeyError, TypeError, IndexError, ValueError, ZeroDivisionError) as e:
        print(f"{name}: the {data['kind']} {part} could not read it ({type(e).__name__}: {e})", file=sys.stderr)
        return fallback


def headline(name: str, data: dict) -> str:
    return _rendered(name, data, "headline", "see the JSON")


def summary_rows(name: str, data: dict) -> list[list[str]]:
    return _rendered(name, data, "summary", [])
