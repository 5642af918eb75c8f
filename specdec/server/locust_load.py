"""The soak's external load generator: locust, in a virtual environment of its own.

Locust is never a dependency of specdec: ``ensure_locust`` creates ``venv_dir`` with
``python -m venv`` and installs locust there from PyPI (once; later runs reuse it). The
locustfile streams chat completions, ``users`` at once for ``run_time`` seconds; a request
succeeds when its stream ends with ``[DONE]`` after a finish reason. Users finish the
request they are in when the time is up (``--stop-timeout``) and the locustfile counts every
stream that ended itself (locust's CSV misses those finished while stopping), so the counts
can be compared with /metrics; the CSV gives the latencies (time to the response headers).
"""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

LOCUST_VERSION = "2.47.0"
DEFAULT_VENV = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specdec" / "locust-venv"

LOCUSTFILE = '''
import json, os
from locust import HttpUser, events, task, constant

MODEL = os.environ["SOAK_MODEL"]
MAX_TOKENS = int(os.environ["SOAK_MAX_TOKENS"])
COUNTS = {"ok": 0, "failed": 0}  # every stream that ended, written once all users have stopped
HEADERS = {"Authorization": "Bearer " + os.environ["SOAK_API_KEY"]} if os.environ.get("SOAK_API_KEY") else {}


class Chat(HttpUser):
    wait_time = constant(0)

    @task
    def chat(self):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "def f(x):"}], "max_tokens": MAX_TOKENS,
                "ignore_eos": True, "stream": True, "return_token_ids": True}
        with self.client.post("/v1/chat/completions", json=body, stream=True, catch_response=True,
                              name="chat", headers=HEADERS) as r:
            finished, done = False, False
            for line in r.iter_lines():
                line = line.decode() if isinstance(line, bytes) else line
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    finished = finished or any(c.get("finish_reason") for c in chunk.get("choices", []))
            if r.status_code == 200 and done and finished:
                COUNTS["ok"] += 1
                r.success()
            else:
                COUNTS["failed"] += 1
                r.failure(f"status {r.status_code}, done {done}, finished {finished}")


@events.quitting.add_listener
def _write_counts(environment, **kwargs):
    with open(os.environ["SOAK_COUNTS"], "w") as f:
        json.dump(COUNTS, f)
'''


def ensure_locust(venv_dir: Path = DEFAULT_VENV) -> Path:
    """The locust executable in ``venv_dir``, installing it there first if needed."""
    exe = venv_dir / "bin" / "locust"
    if exe.exists():
        return exe
    print(f"[bench serve --soak] installing locust {LOCUST_VERSION} into {venv_dir}", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv_dir)], check=True)
    subprocess.run([str(venv_dir / "bin" / "pip"), "install", "-q", f"locust=={LOCUST_VERSION}"], check=True)
    return exe


def run_locust(url: str, model: str, users: int, run_time: float, max_tokens: int, api_key: str | None = None,
               venv_dir: Path = DEFAULT_VENV) -> dict:
    """Run locust headless against ``url``; its request and failure counts."""
    exe = ensure_locust(venv_dir)
    with tempfile.TemporaryDirectory(prefix="specdec-locust-") as tmp:
        locustfile = Path(tmp) / "locustfile.py"
        locustfile.write_text(LOCUSTFILE)
        counts_path = Path(tmp) / "counts.json"
        env = {**os.environ, "SOAK_COUNTS": str(counts_path), "SOAK_MODEL": model, "SOAK_MAX_TOKENS": str(max_tokens), "SOAK_API_KEY": api_key or ""}
        env.pop("PYTHONPATH", None)  # the venv's own packages, not this checkout's
        cmd = [str(exe), "-f", str(locustfile), "--headless", "--host", url, "-u", str(users), "-r", str(users),
               "--run-time", f"{int(run_time)}s", "--stop-timeout", "120", "--csv", str(Path(tmp) / "run"),
               "--only-summary", "--loglevel", "WARNING"]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=run_time + 180, check=False)
        stats_path = Path(tmp) / "run_stats.csv"
        rows = list(csv.DictReader(stats_path.read_text().splitlines())) if stats_path.exists() else []
        counts = json.loads(counts_path.read_text()) if counts_path.exists() else None
    chat = next((r for r in rows if r["Name"] == "chat"), None)
    if chat is None or counts is None:
        raise RuntimeError(f"locust recorded no requests (status {proc.returncode}):\n{proc.stderr[-2000:]}")
    return {"users": users, "run_time_s": run_time, "requests": counts["ok"] + counts["failed"],
            "failures": counts["failed"], "csv_requests": int(chat["Request Count"]),
            "headers_ms_p50": float(chat["Median Response Time"]), "headers_ms_p99": float(chat["99%"])}
