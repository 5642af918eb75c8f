"""``specdec bench peers``: the peers comparison of issue #24 (see ``command.py``), and ``render``,
the table it prints and BENCHMARKS.md shows for a result of kind "peers"."""
from __future__ import annotations


def _rounds(values) -> str:
    return " / ".join("-" if v is None else f"{v:.1f}" for v in values)


def _verdict(goal: dict) -> str:
    if goal["met"] is None:
        return f"not measured ({goal['note']})" if goal.get("note") else "not measured"
    return "met" if goal["met"] else "**missed**"


def render(result: dict) -> str:
    from specdec.bench.report import fmt, format_table

    cfg = result["config"]
    lines = [f"target {cfg['target']}, draft {cfg['draft']}; {cfg['num_prompts']} code prompts, {cfg['output_len']} "
             f"new tokens greedy, {cfg['num_threads']} threads, each configuration in its own process, "
             f"{cfg['rounds']} interleaved rounds (per round / median); batch 1 figures are decode tokens/s "
             "(tokens after the first over the time from the first token to the last)"]
    lines.append("Peers: " + "; ".join(f"{k}: {v}" for k, v in result.get("peers", {}).items()))
    runs = result.get("runs", [])
    if runs:
        bw = [r["bandwidth_gb_per_s"] for r in runs]
        load = [r["load_average"][0] for r in runs]
        lines.append(f"Copy bandwidth before each run: {min(bw):.1f}-{max(bw):.1f} GB/s; 1-minute load average "
                     f"{min(load):.2f}-{max(load):.2f} (per run in the JSON)")
    headers = ["engine", "config", "tok/s per round", "median", "x llama.cpp Q4_K_M", "x vLLM same config",
               "accept rate", "mean acc len"]
    rows = [[r["engine"], r["config"], _rounds(r["tokens_per_s_per_round"]), r["median"], r.get("x_reference"),
             r.get("x_vllm_same"), r.get("acceptance_rate"), r.get("mean_acceptance_length")]
            for r in sorted(result.get("rows", []), key=lambda r: -(r["median"] or 0))]
    if rows:
        lines.append("Batch 1, decode tokens/s:\n\n" + format_table(headers, rows))
    if result.get("batch_rows"):
        brows = [[r["engine"], r["config"], _rounds(r["tokens_per_s_per_round"]), r["median"], r.get("x_vllm_same"),
                  r.get("acceptance_rate")] for r in result["batch_rows"]]
        lines.append(f"Batch {cfg['batch_size']} ({cfg['batch_size']} prompts x {cfg['output_len']} tokens, one "
                     "generate), total output tokens/s:\n\n"
                     + format_table(["engine", "config", "tok/s per round", "median", "x vLLM same config",
                                     "accept rate"], brows))
    if result.get("goals"):
        lines.append("Goals (paired: median over rounds of the per-round ratio):\n\n" + format_table(
            ["goal", "measured", "target", "result"],
            [[g["goal"], fmt(g["measured"]), f"{g['target']}x", _verdict(g)] for g in result["goals"]]))
    skipped = result.get("skipped", [])
    notes = list(result.get("notes", [])) + [f"skipped {s['label']} (batch {s['batch_size']}): {s['why']}"
                                             for s in skipped]
    errors = [f"{r['engine']}: {r['config']}: {e}" for r in result.get("rows", []) + result.get("batch_rows", [])
              for e in r.get("errors", [])]
    if notes or errors:
        lines.append("\n".join(f"- {n}" for n in notes + [f"failed run: {e}" for e in errors]))
    return "\n\n".join(lines)
