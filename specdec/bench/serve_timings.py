"""Where one request's time goes, the same split for specdec's server and ``llama-server``.

``llama-server`` answers each request with ``timings``: prompt tokens it computed (``prompt_n``;
``cache_n`` more came from its prompt cache) and their milliseconds, tokens it generated
(``predicted_n``) and the milliseconds from the first one to the last. specdec's server reports
no per-request timings, but its ``/metrics`` counters only grow and serve-peers runs one request
at a time, so the difference of two scrapes around a request is that request's: the engine's
prefill step (target forward over the prompt; for a draft model, the draft's pass over the same
prompt and its first proposals) and decode steps, each split into target / draft / sampling /
other (``engine/step_timings.py``), and the server's arrival-to-finish time (e2e histogram).

Both come out as one dict per request (``timings``):
- ``prompt_n``, ``cache_n``, ``prompt_ms``, ``prompt_per_second``: prompt processing;
- ``predicted_n`` (every completion token), ``predicted_ms`` (after the first token),
  ``predicted_per_second``: decoding, llama-server's convention for both;
- ``server_ms``: the engine's time for the request (specdec: from the HTTP request's admission to
  its last token; llama-server: prompt_ms + predicted_ms), ``client_ms``: the client's wait,
  ``outside_ms`` = client - server (HTTP, JSON, tokenizing, queues between threads);
- specdec only: ``steps`` (per phase: steps, target rows, milliseconds per part) and
  ``engine_other_ms`` (server time outside steps: admission to the first step, building outputs).
"""
from __future__ import annotations

import statistics

PHASES = ("prefill", "decode")
PARTS = ("target", "draft", "sampling", "other")


def metric_samples(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text as {(sample name, sorted labels without model_name): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(client, url: str) -> dict[tuple[str, tuple], float]:
    """A server's ``/metrics`` (``metric_samples``)."""
    r = client.get(url + "/metrics")
    r.raise_for_status()
    return metric_samples(r.text)


def specdec_timings(before: dict, after: dict, prompt_tokens: int, completion_tokens: int, client_s: float) -> dict:
    """One request's timings from the scrapes before and after it (nothing else ran between)."""
    def delta(name: str, **labels) -> float:
        key = ("specdec:" + name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    steps = {}
    for phase in PHASES:
        ms = {part: 1e3 * delta("engine_step_seconds_total", phase=phase, part=part) for part in PARTS}
        steps[phase] = {"steps": int(delta("engine_steps_total", phase=phase)),
                        "tokens": int(delta("engine_step_tokens_total", phase=phase)), "ms": ms,
                        "total_ms": sum(ms.values())}
    prompt_n = steps["prefill"]["tokens"]
    server_ms = 1e3 * delta("e2e_request_latency_seconds_sum")
    out = _common(prompt_n, max(0, prompt_tokens - prompt_n), steps["prefill"]["total_ms"], completion_tokens,
                  steps["decode"]["total_ms"], server_ms, client_s)
    out.update(steps=steps, engine_other_ms=server_ms - steps["prefill"]["total_ms"] - steps["decode"]["total_ms"],
               num_drafts=int(delta("spec_decode_num_drafts_total")),
               num_accepted_tokens=int(delta("spec_decode_num_accepted_tokens_total")))
    return out


def llama_timings(timings: dict | None, completion_tokens: int, client_s: float) -> dict | None:
    """llama-server's ``timings`` of one response in the common shape (None if it sent none)."""
    if not timings:
        return None
    prompt_ms, predicted_ms = float(timings["prompt_ms"]), float(timings["predicted_ms"])
    return _common(int(timings["prompt_n"]), int(timings.get("cache_n", 0)), prompt_ms,
                   int(timings.get("predicted_n", completion_tokens)), predicted_ms, prompt_ms + predicted_ms, client_s)


def _common(prompt_n: int, cache_n: int, prompt_ms: float, predicted_n: int, predicted_ms: float, server_ms: float,
            client_s: float) -> dict:
    return {"prompt_n": prompt_n, "cache_n": cache_n, "prompt_ms": prompt_ms,
            "prompt_per_second": 1e3 * prompt_n / prompt_ms if prompt_ms > 0 else None,
            "predicted_n": predicted_n, "predicted_ms": predicted_ms,
            "predicted_per_second": 1e3 * predicted_n / predicted_ms if predicted_ms > 0 else None,
            "server_ms": server_ms, "client_ms": 1e3 * client_s, "outside_ms": 1e3 * client_s - server_ms}


SPLIT_KEYS = ("prompt_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms", "predicted_per_second",
              "server_ms", "client_ms", "outside_ms")


def summarize_timings(records: list[dict], engines: list[str]) -> dict:
    """Per engine: the median of each split figure over its requests, and for specdec the mean
    milliseconds per request of each phase's parts and of the engine's time outside steps."""
    out = {}
    for name in engines:
        mine = [r["timings"] for r in records if r["engine"] == name and r.get("timings")]
        if not mine:
            continue
        row = {k: _median([t[k] for t in mine]) for k in SPLIT_KEYS}
        if "steps" in mine[0]:
            row["mean_ms"] = {phase: {part: statistics.fmean(t["steps"][phase]["ms"][part] for t in mine)
                                      for part in PARTS} for phase in PHASES}
            row["mean_ms"]["engine_other"] = statistics.fmean(t["engine_other_ms"] for t in mine)
            row["mean_decode_steps"] = statistics.fmean(t["steps"]["decode"]["steps"] for t in mine)
        out[name] = row
    return out


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def render_timings(split: dict) -> list[str]:
    from specdec.bench.report import format_table

    if not split:
        return []
    rows = [[name, s["prompt_per_second"], s["predicted_per_second"], s["prompt_ms"], s["predicted_ms"],
             s["server_ms"], s["client_ms"], s["outside_ms"]] for name, s in split.items()]
    lines = ["", "per request (medians): prompt = prompt processing, decode = after the first token",
             format_table(["server", "prompt tok/s", "decode tok/s", "prompt ms", "decode ms", "server ms",
                           "client ms", "outside ms"], rows)]
    parts = [[name, phase, *(s["mean_ms"][phase][p] for p in PARTS)]
             for name, s in split.items() if "mean_ms" in s for phase in PHASES]
    if parts:
        lines += ["", "specdec engine steps, mean ms per request (outside steps: "
                  + ", ".join(f"{n} {s['mean_ms']['engine_other']:.1f}" for n, s in split.items() if "mean_ms" in s)
                  + ")", format_table(["server", "phase", *PARTS], parts)]
    return lines
