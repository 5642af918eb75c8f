"""``specdec bench serve``: an HTTP load generator for a specdec server on this machine.

Closed loop (``--concurrency`` clients) and/or open loop (``--request-rate``, Poisson
arrivals), a bounded number of requests and a bounded time per level. Every request
streams (with ``return_token_ids`` so each chunk's token count is exact) and is timed on
the client: TTFT = send -> first token; inter-token latency = gap between chunks / tokens
in the chunk, one sample per token. Acceptance comes from the server's /metrics, scraped
before and after each level. With ``--model`` (no ``--url``) the server is spawned here,
on a free loopback port; ``--compare-baseline`` spawns the same model without speculation
too and reports the ratios side by side. Only loopback targets are accepted.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field

from specdec.server.launcher import SpawnedServer, check_loopback, engine_argv
from specdec.server.metrics import parse_spec_counters
from specdec.bench.soak import add_soak_args, cmd_soak

KEYS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def add_serve_parser(bench_subparsers) -> argparse.ArgumentParser:
    from specdec.cli import add_engine_args

    p = bench_subparsers.add_parser("serve", help="load-test an HTTP server (spawned here, or --url)",
                                    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)  # used to spawn the server when there is no --url
    g = p.add_argument_group("target")
    g.add_argument("--url", default=None, help="a running server, e.g. http://127.0.0.1:8000 (loopback only)")
    g.add_argument("--api-key", default=None)
    g.add_argument("--server-args", default="", help="extra flags for the spawned server, one shell-quoted string")
    g.add_argument("--compare-baseline", action="store_true",
                   help="also spawn the model without speculation; report both and their ratios")
    g.add_argument("--server-log", default=None, help="where the spawned server writes its log")
    g = p.add_argument_group("load")
    g.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    g.add_argument("--concurrency", type=int, nargs="+", default=[4], help="one run per value, e.g. 1 4 16")
    g.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson (inf: all at once)")
    g.add_argument("--num-prompts", type=int, default=64, help="requests per run")
    g.add_argument("--max-duration", type=float, default=120.0, help="seconds per run; later requests are cut")
    g.add_argument("--input-len", type=int, default=128, help="approximate prompt tokens (4 characters each)")
    g.add_argument("--output-len", type=int, default=64, help="max_tokens (EOS ignored unless --stop-at-eos)")
    g.add_argument("--stop-at-eos", action="store_true")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--prompts-file", default=None, help="JSONL ({'prompt': ...}) or text, one prompt a line")
    g.add_argument("--dataset-seed", type=int, default=0)
    g.add_argument("--num-warmup", type=int, default=2)
    g.add_argument("--output-json", default=None)
    add_soak_args(p)
    p.set_defaults(func=cmd_bench_serve)
    return p


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    num_output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def make_prompts(args) -> list[str]:
    rng = random.Random(args.dataset_seed)
    if args.prompts_file:
        with open(args.prompts_file) as f:
            lines = [line.rstrip("\n") for line in f if line.strip()]
        pool = [json.loads(line)["prompt"] if line.lstrip().startswith("{") else line for line in lines]
        return [pool[i % len(pool)] for i in range(args.num_prompts)]
    import inspect
    import json.decoder
    import json.encoder
    import textwrap

    text = "\n".join(inspect.getsource(m) for m in (json.decoder, json.encoder, textwrap))
    num_chars = max(1, args.input_len * 4)
    starts = [rng.randrange(0, max(1, len(text) - num_chars)) for _ in range(args.num_prompts)]
    return [text[s:s + num_chars] for s in starts]


async def one_request(client, path: str, payload: dict) -> RequestResult:
    t0 = time.perf_counter()
    ttft, last, num_tokens, itl, usage = None, None, 0, [], None
    try:
        async with client.stream("POST", path, json=payload) as r:
            if r.status_code != 200:
                return RequestResult(False, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return RequestResult(False, error=str(chunk["error"].get("message")))
                usage = chunk.get("usage") or usage
                k = sum(len(c.get("token_ids") or []) for c in chunk.get("choices", []))
                if not k:
                    continue
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - t0
                else:
                    itl.extend([(now - last) / k] * k)
                last, num_tokens = now, num_tokens + k
    except Exception as e:  # noqa: BLE001 - a failed request is a data point, not a crash
        return RequestResult(False, error=f"{type(e).__name__}: {e}")
    num_tokens = usage["completion_tokens"] if usage else num_tokens
    return RequestResult(True, ttft or 0.0, time.perf_counter() - t0, num_tokens, itl)


async def run_level(url: str, headers: dict, payloads: list[tuple[str, dict]], concurrency: int, rate: float,
                    max_duration: float, seed: int) -> tuple[list[RequestResult], float, int]:
    """Results of the requests that ended, wall time, and how many were cut by the deadline."""
    import httpx

    rng = random.Random(seed)
    slots = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)

    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=None, limits=limits) as client:
        async def limited(path: str, payload: dict) -> RequestResult:
            async with slots:
                return await one_request(client, path, payload)

        async def issue() -> list[asyncio.Task]:
            tasks = []
            for path, payload in payloads:
                tasks.append(asyncio.create_task(limited(path, payload)))
                if rate != float("inf"):
                    await asyncio.sleep(rng.expovariate(rate))
            return tasks

        start = time.perf_counter()
        issuer = asyncio.create_task(issue())
        done, _ = await asyncio.wait({issuer}, timeout=max_duration)
        tasks = issuer.result() if done else []
        if not done:
            issuer.cancel()
        remaining = max(0.0, max_duration - (time.perf_counter() - start))
        finished, pending = await asyncio.wait(tasks, timeout=remaining) if tasks else (set(), set())
        for t in pending:
            t.cancel()  # closing the connection makes the server abort the request
        await asyncio.gather(*pending, return_exceptions=True)
        elapsed = time.perf_counter() - start
    return [t.result() for t in tasks if t in finished], elapsed, len(pending) + (len(payloads) - len(tasks))


async def scrape_spec_counters(url: str) -> dict:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        r = await c.get("/metrics")
        r.raise_for_status()
    return parse_spec_counters(r.text)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(label: str, concurrency: int, results: list[RequestResult], elapsed: float, num_cut: int,
              before: dict, after: dict) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok]
    itl = [x for r in ok for x in r.itl]
    out_tokens = sum(r.num_output_tokens for r in ok)
    d = {k: after.get(k, 0) - before.get(k, 0) for k in KEYS}
    per_pos = [a - b for a, b in zip(after.get("per_pos", []), before.get("per_pos", []) + [0] * 64)]
    return {
        "server": label, "concurrency": concurrency, "completed": len(ok), "failed": len(results) - len(ok),
        "cut_by_deadline": num_cut, "duration_s": round(elapsed, 3),
        "request_throughput": len(ok) / elapsed if elapsed else 0.0,
        "output_throughput": out_tokens / elapsed if elapsed else 0.0, "output_tokens": out_tokens,
        "ttft_ms_mean": 1e3 * sum(ttft) / len(ttft) if ttft else 0.0,
        "ttft_ms_p50": 1e3 * percentile(ttft, 50), "ttft_ms_p99": 1e3 * percentile(ttft, 99),
        "itl_ms_p50": 1e3 * percentile(itl, 50), "itl_ms_p99": 1e3 * percentile(itl, 99),
        **d,
        "acceptance_rate": d["num_accepted_tokens"] / d["num_draft_tokens"] if d["num_draft_tokens"] else None,
        "mean_acceptance_length": 1 + d["num_accepted_tokens"] / d["num_drafts"] if d["num_drafts"] else None,
        "acceptance_per_position": [a / d["num_drafts"] for a in per_pos] if d["num_drafts"] else [],
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }


def payloads_for(args, model: str, prompts: list[str]) -> list[tuple[str, dict]]:
    out = []
    for i, prompt in enumerate(prompts):
        body = {"model": model, "max_tokens": args.output_len, "temperature": args.temperature,
                "ignore_eos": not args.stop_at_eos, "stream": True, "stream_options": {"include_usage": True},
                "return_token_ids": True, "seed": args.dataset_seed + i}
        if args.endpoint == "chat":
            out.append(("/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}))
        else:
            out.append(("/v1/completions", {**body, "prompt": prompt}))
    return out


async def bench_server(args, label: str, url: str) -> list[dict]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as c:
        r = await c.get("/v1/models")
        r.raise_for_status()
        model = r.json()["data"][0]["id"]
    payloads = payloads_for(args, model, make_prompts(args))
    if args.num_warmup:
        await run_level(url, headers, payloads[: args.num_warmup], args.num_warmup, float("inf"), 300.0, 0)
    rows = []
    for level, concurrency in enumerate(args.concurrency):
        before = await scrape_spec_counters(url)
        results, elapsed, num_cut = await run_level(url, headers, payloads, concurrency, args.request_rate,
                                                    args.max_duration, args.dataset_seed + level)
        after = await scrape_spec_counters(url)
        rows.append(summarize(label, concurrency, results, elapsed, num_cut, before, after))
    return rows


def format_table(rows: list[dict]) -> str:
    cols = [("server", "server", "{}"), ("conc", "concurrency", "{}"), ("done", "completed", "{}"),
            ("fail", "failed", "{}"), ("req/s", "request_throughput", "{:.2f}"),
            ("out tok/s", "output_throughput", "{:.1f}"), ("TTFT p50 ms", "ttft_ms_p50", "{:.1f}"),
            ("TTFT p99 ms", "ttft_ms_p99", "{:.1f}"), ("ITL p50 ms", "itl_ms_p50", "{:.2f}"),
            ("ITL p99 ms", "itl_ms_p99", "{:.2f}"), ("accept", "acceptance_rate", "{:.3f}"),
            ("mean acc len", "mean_acceptance_length", "{:.2f}")]
    cells = [[h for h, _, _ in cols]] + [[("-" if r[k] is None else f.format(r[k])) for _, k, f in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def ratios(rows: list[dict]) -> list[dict]:
    base = {r["concurrency"]: r for r in rows if r["server"] == "baseline"}
    out = []
    for r in rows:
        b = base.get(r["concurrency"])
        if r["server"] == "baseline" or b is None or not b["output_throughput"]:
            continue
        out.append({"concurrency": r["concurrency"],
                    "output_throughput_ratio": r["output_throughput"] / b["output_throughput"],
                    "itl_p50_ratio": r["itl_ms_p50"] / b["itl_ms_p50"] if b["itl_ms_p50"] else None})
    return out


def cmd_bench_serve(args) -> int:
    if args.soak:
        return cmd_soak(args, make_prompts(args))
    if args.url:
        check_loopback(args.url)
        targets = [("server", args.url, None)]
    else:
        argv = engine_argv(args)
        targets = [("spec" if args.compare_baseline else "server", None, argv)]
        if args.compare_baseline:
            targets.append(("baseline", None, [*argv, "--no-speculation"]))
    rows = []
    for label, url, argv in targets:
        if url is not None:
            rows += asyncio.run(bench_server(args, label, url))
            continue
        with SpawnedServer(argv, args.server_args, args.api_key, args.server_log) as server:
            print(f"[bench serve] {label}: spawned {server.url} ({server.ready_s:.1f} s to ready)", file=sys.stderr)
            rows += asyncio.run(bench_server(args, label, server.url))
    print(f"specdec bench serve: {args.endpoint}, {args.num_prompts} prompts x {args.output_len} tokens, "
          f"~{args.input_len} prompt tokens, rate {args.request_rate} req/s, temperature {args.temperature}")
    print(format_table(rows))
    cmp = ratios(rows)
    for c in cmp:
        print(f"concurrency {c['concurrency']}: speculative / baseline output tok/s = "
              f"{c['output_throughput_ratio']:.2f}x")
    if args.output_json:
        from specdec.bench.report import result_header, write_json

        config = {k: v for k, v in vars(args).items() if k not in ("func", "bench_parser")}
        write_json({**result_header(args, "serve", None), "config": config, "runs": rows, "ratios": cmp},
                   args.output_json)
    return 0 if all(r["completed"] for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m specdec.bench.serve ...`` (the same as ``specdec bench serve ...``)."""
    parser = argparse.ArgumentParser(prog="python -m specdec.bench.serve")
    sub = parser.add_subparsers(dest="bench_command", required=True)
    add_serve_parser(sub)
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except ValueError as e:
        print(f"specdec bench serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
