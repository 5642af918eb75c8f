"""``specdec bench peers``: specdec against vLLM CPU and llama.cpp, every configuration in its own
process, engines interleaved in rounds (each round starts the rotation one configuration later).

Before each run: the copy bandwidth (``roofline.measure_bandwidth``) and the load average are
recorded beside it. Peers are found, never installed; a configuration whose peer or file is
missing is skipped with the reason.
"""
from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

from specdec.bench.peers import llama_cpp, runner
from specdec.bench.peers.configs import (
    BATCH1_CONFIGS, BATCH_CONFIGS, ENGINES, LLAMA_CPP, SPECDEC, VLLM, missing_requirement, select,
)
from specdec.bench.peers.goals import add_ratios, goal_checks
from specdec.bench.report import median


def add_peers_parser(sub):
    p = sub.add_parser("peers", help="specdec vs vLLM CPU and llama.cpp (found, never installed), in rounds")
    p.add_argument("--target", default="Qwen2.5-Coder-1.5B-Instruct", help="HF folder or known name")
    p.add_argument("--draft", default="Qwen2.5-Coder-0.5B-Instruct", help="HF folder or known name")
    p.add_argument("--target-gguf", default=None, help="Q4_K_M GGUF of the target (default: the one specdec "
                   "converted the target from, in its downloads cache)")
    p.add_argument("--draft-gguf", default=None, help="Q4_K_M GGUF of the draft (default: as --target-gguf)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="the batch round's number of prompts (0: none)")
    p.add_argument("--batch-rounds", type=int, default=1)
    p.add_argument("--num-prompts", type=int, default=8, help="batch 1: the first N of the 8 code prompts")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--cpus", default="0-1", help="vLLM's VLLM_CPU_OMP_THREADS_BIND")
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    p.add_argument("--only", nargs="+", default=None, help="run only configs whose 'engine: name' has a substring")
    p.add_argument("--vllm-python", default=runner.default_vllm_python(),
                   help="python of a venv with vLLM CPU (default $SPECDEC_VLLM_PYTHON, else "
                        f"{runner.DEFAULT_VLLM_PYTHON} if it exists)")
    p.add_argument("--vllm-kvcache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--llama-cpp-dir", default=None, help="folder of llama-server / llama-bench (default "
                   "$SPECDEC_LLAMA_CPP, else PATH, else ~/.cache/specdec/peers/llama.cpp/build/bin)")
    p.add_argument("--no-convert", action="store_true", help="do not convert the target to bf16 / Q8_0 GGUFs")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    p.add_argument("--bandwidth-mib", type=int, default=512)
    p.add_argument("--log-dir", default=None, help="each run's log (default: the peers cache, by date)")
    p.add_argument("--dry-run", action="store_true", help="find the peers, list what would run or be skipped, run nothing")
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=cmd_peers)
    return p


def cmd_peers(args) -> int:
    from specdec.bench.peers import render
    from specdec.bench.report import run_benchmark

    return run_benchmark(args, measure, render)


def _log(msg: str) -> None:
    print(f"[peers {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def find_ggufs(args, target: str, draft: str, bin_dir, notes: list[str]) -> dict:
    ggufs = {"q4_k_m": args.target_gguf or llama_cpp.downloaded_gguf(target),
             "draft_q4_k_m": args.draft_gguf or llama_cpp.downloaded_gguf(draft)}
    for kind in ("bf16", "q8_0"):
        if LLAMA_CPP not in args.engines:
            continue
        if bin_dir is None or args.no_convert:
            ggufs[f"{kind}_why"] = "--no-convert" if args.no_convert else "no llama.cpp"
            continue
        path, why = llama_cpp.converted_gguf(target, kind, bin_dir, _log)
        ggufs[kind], ggufs[f"{kind}_why"] = path, why
        if why:
            notes.append(f"llama.cpp {kind}: {why}")
    return ggufs


def code_prompt_ids(target: str, n: int) -> list[list[int]]:
    """The bench's 8 code prompts (``driver.CODE_PROMPTS``) cycled to ``n``, as the target's token ids:
    every engine gets the very same ids."""
    from transformers import AutoTokenizer

    from specdec.bench.driver import CODE_PROMPTS

    tok = AutoTokenizer.from_pretrained(target)
    return [tok.encode(CODE_PROMPTS[i % len(CODE_PROMPTS)]) for i in range(n)]


def summarize(runs: list[dict], configs, rounds: int) -> list[dict]:
    rows = []
    for c in configs:
        mine = [r for r in runs if r["label"] == c.label]
        if not mine:
            continue
        per_round = [None] * rounds
        for r in mine:
            per_round[r["round"]] = r.get("tokens_per_s")
        acc = [r["acceptance"] for r in mine if r.get("acceptance")]
        rows.append({"engine": c.engine, "config": c.name, "match": c.match, "speculative": c.speculative,
                     "tokens_per_s_per_round": per_round, "median": median(per_round),
                     "acceptance_rate": median(a.get("acceptance_rate") for a in acc) if acc else None,
                     "mean_acceptance_length": median(a.get("mean_acceptance_length") for a in acc) if acc else None,
                     "errors": [r["error"] for r in mine if r.get("error")]})
    for row in rows:
        if row["median"] != row["median"]:  # nan: every round failed
            row["median"] = None
    return rows


def measure(args) -> dict:
    from specdec.bench.report import result_header
    from specdec.bench.roofline import measure_bandwidth
    from specdec.models.hub import resolve_model

    target, draft = resolve_model(args.target), resolve_model(args.draft)
    notes: list[str] = []
    vllm_version, vllm_how = runner.probe_vllm(args.vllm_python) if VLLM in args.engines else (None, "not asked")
    bin_dir, llama_how = llama_cpp.find_bin_dir(args.llama_cpp_dir) if LLAMA_CPP in args.engines else (None, "")
    ggufs = find_ggufs(args, target, draft, bin_dir, notes)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    log_dir = Path(args.log_dir) if args.log_dir else llama_cpp.peers_dir() / "logs" / stamp
    log_dir.mkdir(parents=True, exist_ok=True)
    setup = runner.Setup(target=target, draft=draft, threads=args.num_threads, cpus=args.cpus,
                         output_len=args.output_len, max_model_len=args.output_len + 256, log_dir=log_dir,
                         vllm_python=args.vllm_python if vllm_version else None,
                         vllm_kvcache_gib=args.vllm_kvcache_gib, llama_bin=bin_dir, ggufs=ggufs,
                         timeout_s=args.timeout)
    found = {SPECDEC: "this process's python", VLLM: vllm_version and f"vLLM {vllm_version} ({vllm_how})",
             LLAMA_CPP: bin_dir and f"{bin_dir} ({llama_how})"}
    why_not = {VLLM: vllm_how, LLAMA_CPP: llama_how}
    skipped, plans = [], []
    for batch, configs, n_rounds in ((1, BATCH1_CONFIGS, args.rounds), (args.batch_size, BATCH_CONFIGS,
                                                                        args.batch_rounds)):
        if batch < 1 or n_rounds < 1:
            continue
        runnable = []
        for c in select(configs, args.engines, args.only):
            why = None if found[c.engine] else why_not[c.engine]
            why = why or (missing_requirement(c, ggufs) if c.engine == LLAMA_CPP or c.requires else None)
            if why:
                skipped.append({"label": c.label, "batch_size": batch, "why": why})
                _log(f"skip {c.label} (batch {batch}): {why}")
            else:
                runnable.append(c)
        plans.append((batch, runnable, n_rounds))
    for batch, configs, n_rounds in plans:
        _log(f"batch {batch}, {n_rounds} round(s): " + "; ".join(c.label for c in configs))
    if args.dry_run:
        plans = []
    runs = []
    for batch, configs, n_rounds in plans:
        prompts = code_prompt_ids(target, args.num_prompts if batch == 1 else batch)
        for rnd in range(n_rounds):
            order = configs[rnd % len(configs):] + configs[:rnd % len(configs)] if configs else []
            for c in order:
                bandwidth = measure_bandwidth(args.bandwidth_mib << 20, repeats=3)
                load = list(os.getloadavg())
                tag = f"b{batch}-r{rnd}-{c.engine}-{c.name}".replace(" ", "_").replace("/", "_")
                _log(f"batch {batch} round {rnd + 1}/{n_rounds}: {c.label} (bandwidth {bandwidth / 1e9:.1f} GB/s, "
                     f"load {load[0]:.2f})")
                run = {"round": rnd, "batch_size": batch, "label": c.label, "engine": c.engine, "config": c.name,
                       "bandwidth_gb_per_s": bandwidth / 1e9, "load_average": load}
                t = time.perf_counter()
                try:
                    out = runner.run_config(c, setup, prompts, batch, tag)
                    run.update(tokens_per_s=out["tokens_per_s"], acceptance=out.get("acceptance"), detail=out)
                    _log(f"  -> {out['tokens_per_s']:.2f} tok/s")
                except Exception as e:  # noqa: BLE001 - one failed run is recorded, the rest go on
                    run["error"] = f"{type(e).__name__}: {e}"
                    _log(f"  -> failed: {run['error']} (log {log_dir / tag}.log)")
                run["wall_s"] = time.perf_counter() - t
                runs.append(run)
    rows = summarize([r for r in runs if r["batch_size"] == 1], BATCH1_CONFIGS, args.rounds)
    batch_rows = summarize([r for r in runs if r["batch_size"] != 1], BATCH_CONFIGS, args.batch_rounds)
    add_ratios(rows)
    add_ratios(batch_rows, reference=None)
    bandwidths = [r["bandwidth_gb_per_s"] for r in runs]
    result = result_header(args, "peers", median(bandwidths) * 1e9 if bandwidths else None)
    result.update(
        config={"target": target, "draft": draft, "output_len": args.output_len, "rounds": args.rounds,
                "num_prompts": args.num_prompts, "batch_size": args.batch_size, "batch_rounds": args.batch_rounds,
                "num_threads": args.num_threads, "prompts": "code", "temperature": 0.0,
                "ggufs": {k: str(v) for k, v in ggufs.items() if v and not k.endswith("_why")}},
        peers={k: v or f"not found: {why_not.get(k)}" for k, v in found.items() if k in args.engines},
        notes=notes, skipped=skipped, runs=runs, rows=rows, batch_rows=batch_rows,
        goals=goal_checks(rows, batch_rows, args.batch_size), log_dir=str(log_dir))
    return result
