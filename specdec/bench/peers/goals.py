"""Issue #24's goals, computed from a ``specdec bench peers`` result's rows.

Every ratio is paired: the median over rounds of (A's tokens/s / B's tokens/s in the same round),
so a round where the shared machine slowed everything down cancels out.
"""
from __future__ import annotations

import statistics

from specdec.bench.peers.configs import LLAMA_CPP, REFERENCE, SPECDEC, VLLM


def paired_ratio(a: dict | None, b: dict | None) -> float | None:
    if not a or not b:
        return None
    pairs = [x / y for x, y in zip(a["tokens_per_s_per_round"], b["tokens_per_s_per_round"])
             if x is not None and y is not None and y > 0]
    return statistics.median(pairs) if pairs else None


def find(rows: list[dict], engine: str, name: str) -> dict | None:
    return next((r for r in rows if r["engine"] == engine and r["config"] == name and r.get("median")), None)


def same_config(rows: list[dict], row: dict, engine: str) -> dict | None:
    """The ``engine`` row compared with ``row`` (same ``match`` key), if it ran."""
    if not row.get("match"):
        return None
    return next((r for r in rows if r["engine"] == engine and r.get("match") == row["match"] and r.get("median")),
                None)


def add_ratios(rows: list[dict], reference: tuple[str, str] | None = REFERENCE) -> None:
    ref = find(rows, *reference) if reference else None
    for row in rows:
        row["x_reference"] = paired_ratio(row, ref) if ref is not None else None
        other = same_config(rows, row, VLLM) if row["engine"] != VLLM else None
        row["x_vllm_same"] = paired_ratio(row, other)


def _goal(goal: str, value: float | None, target: float, why_missing: str = "", strict: bool = False) -> dict:
    met = None if value is None else (value > target if strict else value >= target)
    return {"goal": goal, "measured": value, "target": target, "met": met,
            "note": why_missing if value is None else ""}


def goal_checks(rows: list[dict], batch_rows: list[dict], batch_size: int = 32) -> list[dict]:
    """The batch-1 goals when batch-1 rows ran, the batch goals when a batch round was asked for."""
    goals = _batch1_goals(rows) if rows else []
    if batch_size > 0:
        for name in ("bf16 plain", "n-gram K=5"):
            ours, theirs = find(batch_rows, SPECDEC, name), find(batch_rows, VLLM, name)
            goals.append(_goal(f"batch {batch_size} specdec {name} >= vLLM {name}", paired_ratio(ours, theirs), 1.0,
                               "one of the two did not run"))
    return goals


def _batch1_goals(rows: list[dict]) -> list[dict]:
    goals = []
    plain = find(rows, SPECDEC, "bf16 plain")
    for engine, name in ((VLLM, "bf16 plain"), (LLAMA_CPP, "bf16 plain")):
        peer = find(rows, engine, name)
        goals.append(_goal(f"specdec bf16 plain >= {engine} {name}", paired_ratio(plain, peer), 1.0,
                           f"{'specdec' if plain is None else engine} {name} did not run"))
    asked = find(rows, SPECDEC, 'dtype="bfloat16" plain')
    for name in ("bf16 plain", "bf16 plain (llama-bench tg128)"):
        peer = find(rows, LLAMA_CPP, name)
        if asked is not None and peer is not None:
            goals.append(_goal(f'specdec dtype="bfloat16" plain >= llama.cpp {name}', paired_ratio(asked, peer), 1.0))
    ours, theirs = find(rows, SPECDEC, "bf16 + bf16 draft K=5"), find(rows, VLLM, "bf16 + bf16 draft K=5")
    goals.append(_goal("specdec bf16 + bf16 draft K=5 >= 1.2x vLLM same config", paired_ratio(ours, theirs), 1.2,
                       "one of the two did not run"))
    ref = find(rows, *REFERENCE)
    specdec_rows = [r for r in rows if r["engine"] == SPECDEC and r.get("median")]
    best = max(specdec_rows, key=lambda r: paired_ratio(r, ref) or r["median"], default=None)
    best_name = best["config"] if best else "-"
    goals.append(_goal(f"best specdec ({best_name}) >= 1.5x llama.cpp Q4_K_M plain", paired_ratio(best, ref), 1.5,
                       "llama.cpp Q4_K_M plain or every specdec config did not run"))
    spec_llama = [r for r in rows if r["engine"] == LLAMA_CPP and r.get("speculative") and r.get("median")]
    if not spec_llama:
        goals.append(_goal("best specdec ahead of every llama.cpp speculative config", None, 1.0,
                           "no llama.cpp speculative config ran", strict=True))
    for r in spec_llama:
        goals.append(_goal(f"best specdec ({best_name}) ahead of llama.cpp {r['config']}", paired_ratio(best, r), 1.0,
                           "", strict=True))
    return goals
