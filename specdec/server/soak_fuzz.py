"""The fuzz soak (``python -m specdec.server.fuzz soak``): a server process gets the fuzz corpus
for ``--minutes``; its resident memory must level off.

``--clients`` threads each loop over the corpus (hostile bodies, edge values, then seeded
random bodies, fresh grammars among them) until the time is up. Every answer is checked
(``check_answer``: no 5xx, strict JSON, its model). The server's RSS is sampled every
``--sample-every`` seconds; reported: RSS after the first minute (or the first sample when the
run is shorter) and at the end, their ratio, and the answers' statuses; the exit status is 1
if an answer failed its check or the end's RSS is over the baseline's by more than ``--max-growth``.
"""
from __future__ import annotations

import argparse
import json
import random
import threading
import time
from collections import Counter


def add_soak_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--clients", type=int, default=4, help="concurrent client threads")
    p.add_argument("--sample-every", type=float, default=30.0, help="seconds between RSS samples")
    p.add_argument("--warmup-minutes", type=float, default=1.0, help="the RSS baseline is taken after this long")
    p.add_argument("--server-args", default="--max-tokens-limit 32",
                   help="extra `specdec serve` flags (the default keeps every generation short, including "
                        "the corpus' requests that omit max_tokens)")
    p.add_argument("--max-growth", type=float, default=0.05,
                   help="the end's RSS may exceed the baseline's by at most this fraction (else exit 1)")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _client(url: str, seed: int, deadline: float, statuses: Counter, failures: list, lock: threading.Lock) -> None:
    import httpx

    from specdec.server.fuzz import check_answer
    from specdec.server.fuzz_corpus import CORPUS, CORPUS_OK, random_body

    rng = random.Random(seed)
    fixed = list(CORPUS) + [(path, json.dumps(body).encode()) for path, body in CORPUS_OK]
    i = 0
    with httpx.Client(base_url=url, timeout=120) as client:
        while time.monotonic() < deadline:
            path, raw = fixed[i] if i < len(fixed) else random_body(rng)
            i = (i + 1) % (len(fixed) * 4)  # the fixed corpus, then three times as many random bodies
            try:
                r = client.post(path, content=raw, headers={"Content-Type": "application/json"})
                check_answer(path, r.status_code, r.headers.get("content-type", ""), r.content)
                if r.status_code >= 500:
                    raise AssertionError(f"{r.status_code}: {r.text[:300]}")
                with lock:
                    statuses[r.status_code] += 1
            except Exception as e:  # noqa: BLE001 - every failure is reported, the soak goes on
                with lock:
                    failures.append(f"{path} {raw[:200]!r}: {type(e).__name__}: {str(e)[:300]}")


def cmd_soak(args) -> int:
    from specdec.server.launcher import SpawnedServer, engine_argv

    deadline_s = args.minutes * 60
    statuses: Counter = Counter()
    failures: list[str] = []
    lock = threading.Lock()
    samples: list[tuple[float, int]] = []
    with SpawnedServer(engine_argv(args), args.server_args) as server:
        pid = server.proc.pid
        t0 = time.monotonic()
        threads = [threading.Thread(target=_client, args=(server.url, seed, t0 + deadline_s, statuses, failures, lock),
                                    daemon=True) for seed in range(args.clients)]
        for t in threads:
            t.start()
        samples.append((0.0, rss_bytes(pid)))
        while time.monotonic() < t0 + deadline_s:
            time.sleep(min(args.sample_every, max(0.1, t0 + deadline_s - time.monotonic())))
            samples.append((time.monotonic() - t0, rss_bytes(pid)))
            print(f"  {samples[-1][0]:6.0f} s  RSS {samples[-1][1] / 2**20:7.1f} MiB  answers {sum(statuses.values())}",
                  flush=True)
        for t in threads:
            t.join()
        samples.append((time.monotonic() - t0, rss_bytes(pid)))
    warm = next((s for s in samples if s[0] >= args.warmup_minutes * 60), samples[min(1, len(samples) - 1)])
    end = samples[-1]
    ratio = end[1] / warm[1] if warm[1] else float("nan")
    print(f"RSS at {warm[0]:.0f} s: {warm[1] / 2**20:.1f} MiB; at the end ({end[0]:.0f} s): {end[1] / 2**20:.1f} MiB "
          f"({(ratio - 1) * 100:+.1f}%)")
    print(f"answers: {sum(statuses.values())}, statuses {dict(sorted(statuses.items()))}; failures: {len(failures)}")
    for f in failures[:10]:
        print("  ", f)
    grew = ratio > 1 + args.max_growth
    if grew:
        print(f"RSS grew by more than {args.max_growth:.0%} after the warm-up")
    return 1 if failures or grew else 0
