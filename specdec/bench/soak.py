"""The soak behind ``specdec bench serve --soak``: rounds of concurrent streaming chat with
mid-stream disconnects, preemption and a client that stops reading; nothing may be lost or
leaked and memory must level off.

A round is ``concurrency`` streaming chat requests at once, ``num_disconnects`` of which
hang up after their ``disconnect_after``-th chunk, and one more client sends a long request
and never reads (a small receive window: the server's ``--write-timeout`` must let go of it);
the first round is the warm-up, whose RSS the last round's must stay within 5% of. After every round the server must go idle
(nothing running or in flight, every KV block free, within ``idle_timeout``). A request is
lost if its stream ends without ``[DONE]`` after a finish reason or an in-band error. Then,
optionally, SIGTERM in the middle of a round: every stream must end with ``[DONE]`` and the
server exit 0. Reported: per round the client's counts and the server's counter deltas,
preemptions and the server's RSS; TTFT / inter-token latency percentiles of measured rounds.
"""
from __future__ import annotations

import asyncio
import json
import socket
import time
from dataclasses import dataclass, field

SERVER_ARGS = "--write-timeout 2 --shutdown-timeout 10"


@dataclass
class Outcome:
    kind: str  # "completed" | "error" | "disconnected" | "lost"
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    detail: str = ""


async def stream_chat(client, payload: dict, disconnect_after: int | None = None,
                      started: list | None = None) -> Outcome:
    """One streaming chat request; ``started`` gets an entry once its 200 arrived (it is in flight)."""
    t0 = time.perf_counter()
    ttft, last, itl, num_chunks, finished, error = None, None, [], 0, False, None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=payload) as r:
            if r.status_code != 200:
                return Outcome("error", detail=f"HTTP {r.status_code}")
            if started is not None:
                started.append(1)
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    kind = "completed" if finished else "error" if error else "lost"
                    return Outcome(kind, ttft, itl, error or "")
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = str(chunk["error"].get("message"))[:200]
                    continue
                k = sum(len(c.get("token_ids") or []) for c in chunk.get("choices", []))
                finished = finished or any(c.get("finish_reason") for c in chunk.get("choices", []))
                if k:
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - t0
                    else:
                        itl.extend([(now - last) / k] * k)
                    last = now
                num_chunks += 1
                if disconnect_after and num_chunks >= disconnect_after and not finished:
                    return Outcome("disconnected", ttft, itl)  # leaving the block closes the connection
    except Exception as e:  # noqa: BLE001 - a broken stream is a lost request, reported
        return Outcome("lost", detail=f"{type(e).__name__}: {e}")
    return Outcome("lost", detail="the stream ended without [DONE]")


def open_stalled_client(url: str, payload: dict, headers: dict) -> socket.socket:
    """Send a streaming request on a socket with a tiny receive window, and never read it."""
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, int(port)))
    body = json.dumps(payload)
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{extra}"
              f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    return s


def rss_bytes(pid: int | None) -> int | None:
    if pid is None:
        return None
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return None


async def scrape(client) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families((await client.get("/metrics")).text):
        for s in family.samples:
            out[s.name.removeprefix("specdec:")] = out.get(s.name.removeprefix("specdec:"), 0.0) + s.value
    return out


async def wait_idle(client, timeout: float) -> tuple[dict[str, float], float]:
    t0 = time.monotonic()
    while True:
        m = await scrape(client)
        idle = (m["num_requests_running"] == 0 and m["num_requests_in_flight"] == 0
                and m["kv_cache_free_blocks"] == m["kv_cache_total_blocks"] and m["admission_in_use"] == 0)
        if idle or time.monotonic() - t0 > timeout:
            return m, time.monotonic() - t0
        await asyncio.sleep(0.05)


def _delta(after: dict, before: dict, name: str) -> int:
    return int(after.get(name, 0) - before.get(name, 0))


async def run_soak(url: str, headers: dict, model: str, prompts: list[str], pid: int | None, concurrency: int = 64,
                   rounds: int = 3, num_disconnects: int = 16, disconnect_after: int = 3, max_tokens: int = 64,
                   stall_max_tokens: int = 200, idle_timeout: float = 30.0, terminate=None, external=None) -> dict:
    """The soak against ``url``; ``external(url, model)`` (an external load generator's run,
    returning its ``requests`` and ``failures``) runs after the rounds, its counts compared with
    the server's; ``terminate()`` (SIGTERM the server, return its exit status and seconds to
    exit) enables the final SIGTERM round."""
    import httpx

    from specdec.bench.serve import percentile

    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    records, ttft, itl = [], [], []
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=300, limits=limits) as client:
        for rnd in range(rounds + 1):
            before = await scrape(client)
            stalled = open_stalled_client(url, {"model": model, "messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": stall_max_tokens, "ignore_eos": True,
                                                    "logprobs": True, "top_logprobs": 20, "n": 4, "stream": True,
                                                    "return_token_ids": True}, headers)
            t0 = time.perf_counter()
            jobs = []
            for i in range(concurrency):
                payload = {"model": model, "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
                           "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.8, "seed": 1000 * rnd + i,
                           "stream": True, "return_token_ids": True}
                jobs.append(stream_chat(client, payload, disconnect_after if i < num_disconnects else None))
            outcomes = await asyncio.gather(*jobs)
            elapsed = time.perf_counter() - t0
            m, _ = await wait_idle(client, idle_timeout)  # the stalled socket is still open and unread
            stall_released = m["admission_in_use"] == 0 and m["num_requests_in_flight"] == 0
            stalled.close()
            after, idle_s = await wait_idle(client, idle_timeout)
            counts = {k: sum(o.kind == k for o in outcomes) for k in ("completed", "error", "disconnected", "lost")}
            rec = {"round": rnd, "warmup": rnd == 0, "duration_s": round(elapsed, 3), **counts,
                   "stalled_clients": 1, "stalled_released": stall_released,
                   "server_success": sum(_delta(after, before, k) for k in after
                                         if k.startswith("request_success") and k.endswith("_total")),
                   "server_aborted": _delta(after, before, "request_aborted_total"),
                   "server_failed": _delta(after, before, "request_failed_total"),
                   "preemptions": _delta(after, before, "num_preemptions_total"),
                   "leaked_kv_blocks": int(after["kv_cache_total_blocks"] - after["kv_cache_free_blocks"]),
                   "in_flight_after": int(after["num_requests_in_flight"]), "idle_after_s": round(idle_s, 3),
                   "rss_bytes": rss_bytes(pid), "errors": sorted({o.detail for o in outcomes if o.detail})[:3]}
            records.append(rec)
            if rnd > 0:
                ttft += [o.ttft for o in outcomes if o.ttft is not None]
                itl += [x for o in outcomes for x in o.itl]
        ext = None
        if external is not None:
            before = await scrape(client)
            ext = await asyncio.to_thread(external, url, model)
            after, _ = await wait_idle(client, idle_timeout)
            ext["server_success"] = sum(_delta(after, before, k) for k in after
                                        if k.startswith("request_success") and k.endswith("_total"))
            ext["server_aborted_or_failed"] = (_delta(after, before, "request_aborted_total")
                                               + _delta(after, before, "request_failed_total"))
            ext["leaked_kv_blocks"] = int(after["kv_cache_total_blocks"] - after["kv_cache_free_blocks"])
        sigterm = await _sigterm_round(client, model, prompts, concurrency, max_tokens, terminate) if terminate else None
    report = _verdict(records, ttft, itl, sigterm, percentile)
    if ext is not None:
        report["external"] = ext
        report["checks"]["external_counts_match"] = (ext["requests"] > 0 and ext["failures"] == 0
                                                     and ext["server_success"] == ext["requests"]
                                                     and ext["server_aborted_or_failed"] == 0
                                                     and ext["leaked_kv_blocks"] == 0)
        report["passed"] = all(report["checks"].values())
    return report


async def _sigterm_round(client, model, prompts, concurrency, max_tokens, terminate) -> dict:
    payloads = [{"model": model, "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
                 "max_tokens": max_tokens * 4, "ignore_eos": True, "stream": True, "return_token_ids": True}
                for i in range(concurrency)]
    started: list = []
    tasks = [asyncio.create_task(stream_chat(client, p, started=started)) for p in payloads]
    deadline = time.monotonic() + 120
    while len(started) < len(tasks) and time.monotonic() < deadline:  # every stream in flight (its 200 sent)
        await asyncio.sleep(0.05)
    status, exit_s = await asyncio.to_thread(terminate)
    outcomes = await asyncio.gather(*tasks)
    return {"in_flight_at_sigterm": len(started), "exit_status": status, "exit_s": round(exit_s, 2),
            **{k: sum(o.kind == k for o in outcomes) for k in ("completed", "error", "lost")},
            "lost_details": sorted({o.detail for o in outcomes if o.kind == "lost"})[:3]}


def _verdict(records: list[dict], ttft: list[float], itl: list[float], sigterm: dict | None, percentile) -> dict:
    warm_rss, final_rss = records[0]["rss_bytes"], records[-1]["rss_bytes"]
    checks = {
        "no_lost_requests": all(r["lost"] == 0 for r in records),
        "no_leaked_kv_blocks": all(r["leaked_kv_blocks"] == 0 and r["in_flight_after"] == 0 for r in records),
        "server_counts_match": all(r["server_success"] + r["server_aborted"] + r["server_failed"]
                                   == r["completed"] + r["disconnected"] + r["stalled_clients"] for r in records),
        "preemption_happened": any(r["preemptions"] > 0 for r in records),
        "no_errors": all(r["error"] == 0 for r in records),
        "stalled_clients_released": all(r["stalled_released"] for r in records),
    }
    if warm_rss and final_rss:
        checks["rss_within_5pct_of_warmup"] = abs(final_rss - warm_rss) <= 0.05 * warm_rss
    if sigterm is not None:
        checks["sigterm_clean"] = (sigterm["exit_status"] == 0 and sigterm["lost"] == 0
                                   and sigterm["completed"] + sigterm["error"] == sigterm["in_flight_at_sigterm"])
    latency = {"ttft_ms_p50": 1e3 * percentile(ttft, 50), "ttft_ms_p99": 1e3 * percentile(ttft, 99),
               "itl_ms_p50": 1e3 * percentile(itl, 50), "itl_ms_p99": 1e3 * percentile(itl, 99)}
    return {"rounds": records, "latency": latency, "sigterm": sigterm, "checks": checks,
            "passed": all(checks.values()),
            "rss_growth_after_warmup": (final_rss - warm_rss) / warm_rss if warm_rss and final_rss else None}


def format_report(report: dict) -> str:
    cols = ["round", "duration_s", "completed", "error", "disconnected", "lost", "stalled_clients", "server_success",
            "server_aborted", "server_failed", "preemptions", "leaked_kv_blocks", "idle_after_s"]
    lines = ["  ".join(cols + ["rss_MB"])]
    for r in report["rounds"]:
        rss = f"{r['rss_bytes'] / 2**20:.1f}" if r["rss_bytes"] else "-"
        lines.append("  ".join(str(r[c]).rjust(len(c)) for c in cols) + f"  {rss:>6}")
    lat = report["latency"]
    lines.append(f"TTFT p50 {lat['ttft_ms_p50']:.1f} ms, p99 {lat['ttft_ms_p99']:.1f} ms; "
                 f"ITL p50 {lat['itl_ms_p50']:.2f} ms, p99 {lat['itl_ms_p99']:.2f} ms")
    if report["rss_growth_after_warmup"] is not None:
        lines.append(f"RSS after the soak vs after warm-up: {100 * report['rss_growth_after_warmup']:+.2f}%")
    if report.get("external"):
        lines.append(f"locust: {report['external']}")
    if report["sigterm"]:
        lines.append(f"SIGTERM mid-round: {report['sigterm']}")
    lines.append("checks: " + ", ".join(f"{k}={'ok' if v else 'FAILED'}" for k, v in report["checks"].items()))
    return "\n".join(lines)


def add_soak_args(p) -> None:
    g = p.add_argument_group("soak (--soak: concurrency = the first --concurrency, max_tokens = --output-len)")
    g.add_argument("--soak", action="store_true", help="run the soak (chat endpoint) instead of the benchmark")
    g.add_argument("--soak-rounds", type=int, default=3, help="measured rounds, after one warm-up round")
    g.add_argument("--soak-disconnects", type=int, default=16, help="clients per round that hang up mid-stream")
    g.add_argument("--soak-sigterm", action="store_true", help="end with SIGTERM mid-round (spawned server only)")
    g.add_argument("--soak-locust", type=float, default=0.0, metavar="SECONDS",
                   help="also drive the server with locust (installed in its own venv) for this long")


async def _soak_at(args, url: str, pid: int | None, prompts: list[str], terminate) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as c:
        info = (await c.get("/v1/models")).json()["data"][0]
    external = None
    if args.soak_locust > 0:
        from specdec.server.locust_load import run_locust

        def external(url: str, model: str) -> dict:
            return run_locust(url, model, min(16, args.concurrency[0]), args.soak_locust, args.output_len,
                              args.api_key)

    return await run_soak(url, headers, info["id"], prompts, pid, concurrency=args.concurrency[0],
                          rounds=args.soak_rounds, num_disconnects=args.soak_disconnects, max_tokens=args.output_len,
                          stall_max_tokens=max(16, info["max_model_len"] - 64), terminate=terminate,
                          external=external)


def cmd_soak(args, prompts: list[str]) -> int:
    import signal
    import sys

    from specdec.server.launcher import SpawnedServer, check_loopback, engine_argv

    if args.url:
        check_loopback(args.url)
        report = asyncio.run(_soak_at(args, args.url, None, prompts, None))
    else:
        with SpawnedServer(engine_argv(args), f"{SERVER_ARGS} {args.server_args}", args.api_key,
                           args.server_log) as srv:
            print(f"[bench serve --soak] spawned {srv.url} ({srv.ready_s:.1f} s to ready)", file=sys.stderr)

            def terminate() -> tuple[int, float]:
                t0 = time.monotonic()
                srv.proc.send_signal(signal.SIGTERM)
                return srv.proc.wait(120), time.monotonic() - t0

            report = asyncio.run(_soak_at(args, srv.url, srv.proc.pid, prompts,
                                          terminate if args.soak_sigterm else None))
    print(format_report(report))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"config": {k: v for k, v in vars(args).items() if k not in ("func", "bench_parser")},
                       **report}, f, indent=1, default=str)
    return 0 if report["passed"] else 1
