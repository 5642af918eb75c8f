"""Float32 vs int8 vs int4 weights end to end: ``specdec bench latency`` single thread, the three
weight formats alternating round by round (each run its own process, its own bandwidth copies),
for the embedded default pair (plain and speculative) and a plain Qwen2.5-Coder-0.5B-Instruct.

    python scripts/bench_quant_e2e.py --rounds 3 --out bench_results/quant_e2e

Prints one markdown table: decode tokens/s (median over rounds), weight bytes read per token,
the fraction of the bandwidth roofline each reached, and the ratio to float32 of the same round.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

TARGETS = {"default pair": [], "Qwen2.5-Coder-0.5B-Instruct": ["--model", "Qwen2.5-Coder-0.5B-Instruct"]}
FORMATS = {"float32": [], "int8": ["--quantization", "int8"], "int4": ["--quantization", "int4"],
           "w8a8": ["--quantization", "w8a8"], "w4a8": ["--quantization", "w4a8"]}
DEFAULT_FORMATS = "float32,int8,int4"


def run_once(target: str, fmt: str, path: Path, args) -> dict:
    cmd = [sys.executable, "-m", "specdec.cli", "bench", "latency", "--num-threads", "1", "--dtype", "float32",
           "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--num-iters", "1",
           "--prompts", "code", *TARGETS[target], *FORMATS[fmt], "--output-json", str(path)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(path.read_text())


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--out", default="bench_results/quant_e2e")
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--formats", default=DEFAULT_FORMATS,
                   help=f"comma-separated, of {', '.join(FORMATS)}; ratios are to the first")
    p.add_argument("--summary-json", default=None, help="also write the table as a bench_results record")
    p.add_argument("--summarize-only", action="store_true", help="read the runs already in --out")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.rounds):
        for target in args.targets.split(","):
            for fmt in args.formats.split(","):
                path = out / f"{target.split()[0].lower()}_{fmt}_r{r}.json"
                if args.summarize_only:
                    if path.is_file():
                        results.setdefault((target, fmt), []).append(json.loads(path.read_text()))
                    continue
                results.setdefault((target, fmt), []).append(run_once(target, fmt, path, args))
                print(f"round {r} {target} {fmt} done", file=sys.stderr, flush=True)
    print(render(results, args.rounds, args.formats.split(",")[0]))
    if args.summary_json:
        write_summary(results, args, Path(args.summary_json), args.formats.split(",")[0])
    return 0


def write_summary(results: dict, args, path: Path, base_fmt: str = "float32") -> None:
    """One record for scripts/make_benchmarks_md.py: provenance of the first run, a row per config."""
    first = next(iter(results.values()))[0]
    rounds = min(len(runs) for runs in results.values())
    record = {"kind": "quant_e2e", "command": f"python scripts/bench_quant_e2e.py --rounds {rounds} "
              f"--input-len {args.input_len} --output-len {args.output_len}"
              + (f" --formats {args.formats}" if args.formats != DEFAULT_FORMATS else ""),
              "date": first["date"], "machine": first["machine"], "versions": first["versions"],
              "note": "each run: " + first["command"], "by_config": {}}
    for (target, fmt), runs in results.items():
        base = results[(target, base_fmt)]
        med = statistics.median
        row = {"plain_decode_tok_s": round(med(r["baseline"]["decode_tokens_per_s"] for r in runs), 2),
               f"plain_vs_{base_fmt}": round(med(r["baseline"]["decode_tokens_per_s"] / b["baseline"]["decode_tokens_per_s"]
                                             for r, b in zip(runs, base)), 2),
               "weight_mb_read_per_token": round(runs[0]["roofline"]["weight_bytes_per_step"] / 1e6),
               "plain_roofline_fraction": round(med(r["roofline_fraction"] for r in runs), 2),
               "copy_gb_s": round(med(r["roofline"]["bandwidth_gb_per_s"] for r in runs), 1)}
        if runs[0].get("speculative"):
            row["spec_decode_tok_s"] = round(med(r["speculative"]["decode_tokens_per_s"] for r in runs), 2)
            row[f"spec_vs_{base_fmt}_plain"] = round(med(r["speculative"]["decode_tokens_per_s"] / b["baseline"]["decode_tokens_per_s"]
                                                     for r, b in zip(runs, base)), 2)
            row["greedy_identical_fraction"] = min(r["speculative"]["greedy_agreement"]["identical_fraction"] for r in runs)
        record["by_config"][f"{target} / {fmt}"] = row
    path.write_text(json.dumps(record, indent=2) + "\n")


def render(results: dict, rounds: int, base_fmt: str = "float32") -> str:
    lines = [f"| target | weights | plain decode tok/s | vs {base_fmt} (same round) | weight MB read / token | "
             f"plain / roofline | speculative tok/s | spec. vs {base_fmt} plain | greedy spec == plain | copy GB/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (target, fmt), runs in results.items():
        base = results[(target, base_fmt)]
        plain = [r["baseline"]["decode_tokens_per_s"] for r in runs]
        ratio = [p / b["baseline"]["decode_tokens_per_s"] for p, b in zip(plain, base)]
        spec = [r["speculative"]["decode_tokens_per_s"] for r in runs if r.get("speculative")]
        spec_ratio = [r["speculative"]["decode_tokens_per_s"] / b["baseline"]["decode_tokens_per_s"]
                      for r, b in zip(runs, base) if r.get("speculative")]
        same = [r["speculative"]["greedy_agreement"]["identical_fraction"] for r in runs if r.get("speculative")]
        med = statistics.median
        lines.append(
            f"| {target} | {fmt} | {med(plain):.1f} | {med(ratio):.2f}x | "
            f"{runs[0]['roofline']['weight_bytes_per_step'] / 1e6:.0f} | {med(r['roofline_fraction'] for r in runs):.2f} | "
            f"{f'{med(spec):.1f}' if spec else '-'} | {f'{med(spec_ratio):.2f}x' if spec else '-'} | "
            f"{f'{min(same):.2f}' if same else '-'} | "
            f"{med(r['roofline']['bandwidth_gb_per_s'] for r in runs):.1f} |")
    return "\n".join(lines) + f"\n(median of {rounds} rounds)"


if __name__ == "__main__":
    raise SystemExit(main())
