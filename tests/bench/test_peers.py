"""``specdec bench peers`` without any peer: configs, commands, parsing of recorded peer output,
goals, rendering, and a missing peer as a clean skip."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from specdec.bench.peers import configs, goals, llama_cpp, render, runner, vllm_worker
from specdec.bench.peers.configs import LLAMA_CPP, SPECDEC, VLLM, PeerConfig

DATA = Path(__file__).with_name("data") / "peers"
ROOT = Path(__file__).resolve().parents[2]


def test_config_labels_are_unique_and_every_engine_has_the_compared_configs():
    for table in (configs.BATCH1_CONFIGS, configs.BATCH_CONFIGS):
        labels = [c.label for c in table]
        assert len(labels) == len(set(labels))
    matches = {(c.engine, c.match) for c in configs.BATCH1_CONFIGS if c.match}
    assert {(SPECDEC, "bf16 plain"), (VLLM, "bf16 plain"), (LLAMA_CPP, "bf16 plain")} <= matches
    assert {(SPECDEC, "bf16 draft K=5"), (VLLM, "bf16 draft K=5")} <= matches
    assert configs.REFERENCE in {(c.engine, c.name) for c in configs.BATCH1_CONFIGS}


def test_quantized_target_configs_follow_the_checked_out_quantization_methods(monkeypatch):
    import specdec.config

    int4 = next(c for c in configs.BATCH1_CONFIGS if c.requires == "quantization:int4")
    monkeypatch.setattr(specdec.config, "QUANTIZATION_METHODS", (None, "int8"))
    assert "int4" in configs.missing_requirement(int4, {})
    monkeypatch.setattr(specdec.config, "QUANTIZATION_METHODS", (None, "int8", "int4"))
    assert configs.missing_requirement(int4, {}) is None


def test_gguf_requirements_name_the_missing_file():
    spec = next(c for c in configs.BATCH1_CONFIGS if c.engine == LLAMA_CPP and c.speculative)
    assert "draft" in configs.missing_requirement(spec, {"q4_k_m": Path("t.gguf")})
    assert configs.missing_requirement(spec, {"q4_k_m": Path("t.gguf"), "draft_q4_k_m": Path("d.gguf")}) is None
    bf16 = next(c for c in configs.BATCH1_CONFIGS if c.requires == "gguf:bf16")
    assert configs.missing_requirement(bf16, {"bf16_why": "convert failed: x"}) == "convert failed: x"


def test_select_and_placeholders():
    only = configs.select(configs.BATCH1_CONFIGS, engines=[VLLM], only=["n-gram"])
    assert [c.label for c in only] == ["vllm: n-gram K=5"]
    spec = configs.substitute({"speculative_config": {"model": "{draft}", "k": 5}, "x": ["{draft}"]}, {"draft": "/d"})
    assert spec == {"speculative_config": {"model": "/d", "k": 5}, "x": ["/d"]}


def _setup(tmp_path, **kw) -> runner.Setup:
    return runner.Setup(target="/t", draft="/d", threads=2, cpus="0-1", output_len=128, max_model_len=384,
                        log_dir=tmp_path, vllm_python="/venv/bin/python", vllm_kvcache_gib=3, **kw)


def test_worker_commands(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    draft = next(c for c in configs.BATCH1_CONFIGS if c.engine == VLLM and c.name == "bf16 + bf16 draft K=5")
    setup = _setup(tmp_path)
    cmd, env = runner.worker_command(draft, setup, tmp_path / "job.json")
    assert cmd[0] == "/venv/bin/python" and cmd[1].endswith("vllm_worker.py")
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert "PYTHONPATH" not in env and env["OMP_NUM_THREADS"] == "2"
    job = runner.job(draft, setup, [[1, 2]], 1)
    assert job["options"]["speculative_config"]["model"] == "/d" and job["model"] == "/t"
    plain = configs.BATCH1_CONFIGS[0]
    cmd, env = runner.worker_command(plain, setup, tmp_path / "job.json")
    assert cmd[:3] == [sys.executable, "-m", "specdec.bench.peers.specdec_worker"]


def test_llama_cpp_commands(tmp_path):
    ggufs = {"q4_k_m": Path("/g/t.gguf"), "draft_q4_k_m": Path("/g/d.gguf")}
    spec = next(c for c in configs.BATCH1_CONFIGS if c.engine == LLAMA_CPP and c.speculative)
    cmd = llama_cpp.server_command(Path("/bin"), spec, ggufs, 8081, 2, 384)
    assert cmd[0] == "/bin/llama-server" and cmd[cmd.index("-m") + 1] == "/g/t.gguf"
    assert cmd[cmd.index("-md") + 1] == "/g/d.gguf" and cmd[cmd.index("--spec-draft-n-max") + 1] == "5"
    assert cmd[cmd.index("--spec-type") + 1] == "draft-simple"  # the default is none: -md alone drafts nothing
    assert cmd[cmd.index("-t") + 1] == "2" and cmd[cmd.index("-np") + 1] == "1"
    assert "--no-repack" in cmd  # off ggml's AMX buffer type, whose tile matmul faults on some AMX VMs
    bench = next(c for c in configs.BATCH1_CONFIGS if c.options.get("tool") == "llama-bench")
    cmd = llama_cpp.bench_command(Path("/bin"), bench, ggufs, 2, 128, 3)
    assert cmd[0] == "/bin/llama-bench" and " ".join(cmd[3:]) == "-p 0 -n 128 -t 2 -r 3 -o json"
    body = llama_cpp.completion_request([1, 2, 3], 128)
    assert body["prompt"] == [1, 2, 3] and body["n_predict"] == 128 and body["ignore_eos"] and body["temperature"] == 0


def test_parse_recorded_llama_server_and_bench_output():
    resp = json.loads((DATA / "llama_server_completion_draft.json").read_text())
    rec = llama_cpp.parse_completion(resp)
    t = resp["timings"]
    assert rec["num_decode_tokens"] == t["predicted_n"] - 1 and rec["decode_s"] == pytest.approx(t["predicted_ms"] / 1e3)
    assert rec["draft_n"] == t["draft_n"]
    acc = llama_cpp.draft_acceptance([rec, rec])
    assert acc["acceptance_rate"] == pytest.approx(t["draft_n_accepted"] / t["draft_n"])
    assert llama_cpp.draft_acceptance([{"num_decode_tokens": 1}]) is None
    bench = llama_cpp.parse_bench((DATA / "llama_bench.txt").read_text())
    assert bench["tokens_per_s"] > 0 and bench["n_gen"] > 0


def test_parse_recorded_worker_output_and_tokens_per_s():
    for name in ("vllm_worker_stdout.txt", "specdec_worker_stdout.txt"):
        out = runner.parse_worker_output((DATA / name).read_text())
        pp = out["per_prompt"]
        assert runner.tokens_per_s(out) == pytest.approx(sum(p["num_decode_tokens"] for p in pp)
                                                         / sum(p["decode_s"] for p in pp))
    assert runner.tokens_per_s({"num_output_tokens": 64, "wall_s": 2.0}) == 32.0
    with pytest.raises(ValueError, match="PEER_RESULT"):
        runner.parse_worker_output("INFO starting\n")


def test_vllm_worker_helpers_without_vllm():
    class Stats:
        scheduled_ts, first_token_ts, last_token_ts = 1.0, 1.5, 3.5

    class Out:
        metrics = Stats()
        outputs = [type("C", (), {"token_ids": list(range(9))})()]

    assert vllm_worker.per_request(Out()) == {"num_output_tokens": 9, "num_decode_tokens": 8, "prefill_s": 0.5,
                                              "decode_s": 2.0}
    before = dict.fromkeys(vllm_worker.COUNTERS, 0)
    after = dict(zip(vllm_worker.COUNTERS, (10, 50, 40)))
    assert vllm_worker.acceptance(before, after) == {"acceptance_rate": 0.8, "mean_acceptance_length": 5.0}
    assert vllm_worker.acceptance(before, before) is None


def _row(engine, name, per_round, match=None, speculative=False):
    return {"engine": engine, "config": name, "match": match, "speculative": speculative,
            "tokens_per_s_per_round": per_round, "median": sorted(per_round)[len(per_round) // 2], "errors": []}


def synthetic_rows():
    rows = [_row(SPECDEC, "bf16 plain", [20.0, 21.0, 14.0], "bf16 plain"),
            _row(SPECDEC, "bf16 + bf16 draft K=5", [40.0, 30.0, 33.0], "bf16 draft K=5", True),
            _row(SPECDEC, "bf16 + int8 draft K=5", [70.0, 62.0, 61.0], None, True),
            _row(VLLM, "bf16 plain", [20.0, 20.0, 15.0], "bf16 plain"),
            _row(VLLM, "bf16 + bf16 draft K=5", [32.0, 23.0, 30.0], "bf16 draft K=5", True),
            _row(LLAMA_CPP, "Q4_K_M plain", [40.0, 40.0, 41.0], "Q4_K_M plain"),
            _row(LLAMA_CPP, "bf16 plain", [20.0, 22.0, 20.0], "bf16 plain"),
            _row(SPECDEC, 'dtype="bfloat16" plain', [21.0, 21.0, 19.0]),
            _row(LLAMA_CPP, "bf16 plain (llama-bench tg128)", [20.0, 20.0, 20.0]),
            _row(LLAMA_CPP, "Q4_K_M + Q4_K_M draft, draft-max 5", [23.0, 21.0, 22.0], "Q4_K_M draft K=5", True)]
    batch = [_row(SPECDEC, "bf16 plain", [700.0], "bf16 plain"), _row(VLLM, "bf16 plain", [650.0], "bf16 plain"),
             _row(SPECDEC, "n-gram K=5", [600.0], "n-gram K=5", True)]
    return rows, batch


def test_goals_are_paired_per_round_ratios():
    rows, batch = synthetic_rows()
    goals.add_ratios(rows)
    by = {(r["engine"], r["config"]): r for r in rows}
    assert by[(SPECDEC, "bf16 plain")]["x_vllm_same"] == pytest.approx(1.0)  # median of 1.0, 1.05, 0.933
    assert by[(SPECDEC, "bf16 + int8 draft K=5")]["x_reference"] == pytest.approx(62 / 40)
    assert by[(VLLM, "bf16 plain")]["x_vllm_same"] is None
    result = {g["goal"]: g for g in goals.goal_checks(rows, batch)}
    assert result["specdec bf16 plain >= vllm bf16 plain"]["met"] is True
    assert result["specdec bf16 plain >= llama.cpp bf16 plain"]["met"] is False  # 1.0, 0.95, 0.7
    asked = result['specdec dtype="bfloat16" plain >= llama.cpp bf16 plain (llama-bench tg128)']
    assert asked["met"] is True and asked["measured"] == pytest.approx(1.05)  # median of 1.05, 1.05, 0.95
    assert result['specdec dtype="bfloat16" plain >= llama.cpp bf16 plain']["met"] is False  # 1.05, 0.955, 0.95
    assert result["specdec bf16 + bf16 draft K=5 >= 1.2x vLLM same config"]["measured"] == pytest.approx(1.25)
    best = result["best specdec (bf16 + int8 draft K=5) >= 1.5x llama.cpp Q4_K_M plain"]
    assert best["met"] is True and best["measured"] == pytest.approx(1.55)
    assert result["best specdec (bf16 + int8 draft K=5) ahead of llama.cpp Q4_K_M + Q4_K_M draft, draft-max 5"]["met"]
    assert result["batch 32 specdec bf16 plain >= vLLM bf16 plain"]["met"] is True
    missing = result["batch 32 specdec n-gram K=5 >= vLLM n-gram K=5"]
    assert missing["met"] is None and missing["note"]


def test_a_run_without_batch_1_rounds_or_without_a_batch_round_has_only_its_own_goals():
    rows, batch = synthetic_rows()
    only_batch = [g["goal"] for g in goals.goal_checks([], batch, 32)]
    assert only_batch == ["batch 32 specdec bf16 plain >= vLLM bf16 plain", "batch 32 specdec n-gram K=5 >= vLLM n-gram K=5"]
    assert not any(g["goal"].startswith("batch") for g in goals.goal_checks(rows, [], 0))


def _result():
    rows, batch = synthetic_rows()
    goals.add_ratios(rows)
    goals.add_ratios(batch, reference=None)
    return {"kind": "peers", "command": "specdec bench peers --rounds 3", "date": "2026-12-01T16:00:00+00:00",
            "machine": {"cpu": "AMD EPYC", "cpu_cores": 2, "bandwidth_gb_per_s": 20.0, "load_average": [1, 1, 1]},
            "config": {"target": "/m/Qwen2.5-Coder-1.5B-Instruct", "draft": "/m/Qwen2.5-Coder-0.5B-Instruct",
                       "output_len": 128, "rounds": 3, "num_prompts": 8, "batch_size": 32, "batch_rounds": 1,
                       "num_threads": 2},
            "peers": {SPECDEC: "this python", VLLM: "vLLM 0.32.0", LLAMA_CPP: "/bin"},
            "runs": [{"bandwidth_gb_per_s": 19.0, "load_average": [2.0, 1, 1]}],
            "skipped": [{"label": "specdec: int4 target plain", "batch_size": 1, "why": "no 'int4'"}],
            "notes": [], "rows": rows, "batch_rows": batch, "goals": goals.goal_checks(rows, batch)}


def test_render_and_benchmarks_md(tmp_path):
    result = _result()
    text = render(result)
    assert "20.0 / 21.0 / 14.0" in text and "x llama.cpp Q4_K_M" in text and "**missed**" in text
    assert "skipped specdec: int4 target plain (batch 1): no 'int4'" in text and "Batch 32" in text
    (tmp_path / "peers_qwen.json").write_text(json.dumps(result))
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import make_benchmarks_md
    finally:
        sys.path.pop(0)
    md = make_benchmarks_md.build(tmp_path)
    assert "specdec bench peers --rounds 3" in md and "2026-12-01T16:00:00" in md and "AMD EPYC" in md
    assert "best specdec (bf16 + int8 draft K=5) >= 1.5x llama.cpp Q4_K_M plain" in md


def test_missing_peers_are_skipped_cleanly(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECDEC_LLAMA_CPP", raising=False)
    bin_dir, why = llama_cpp.find_bin_dir(str(tmp_path))
    assert bin_dir is None and "build_llama_cpp.sh" in why
    version, why = runner.probe_vllm(str(tmp_path / "no" / "python"))
    assert version is None and "does not exist" in why
    version, why = runner.probe_vllm(sys.executable) if _no_vllm() else (None, "cannot import vllm")
    assert version is None and "cannot import vllm" in why


def _no_vllm() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is None


def test_bench_peers_with_no_peer_found_skips_every_config(llama_path, tmp_path, capsys):
    from specdec.cli import main

    out = tmp_path / "peers.json"
    assert main(["bench", "peers", "--target", llama_path, "--draft", llama_path, "--engines", "vllm", "llama.cpp",
                 "--vllm-python", str(tmp_path / "none"), "--llama-cpp-dir", str(tmp_path), "--log-dir",
                 str(tmp_path / "logs"), "--bandwidth-mib", "8", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["kind"] == "peers" and result["runs"] == [] and result["rows"] == []
    assert {s["label"] for s in result["skipped"]} >= {"vllm: bf16 plain", "llama.cpp: Q4_K_M plain"}
    assert all(g["met"] is None for g in result["goals"])
    assert "skipped vllm: bf16 plain" in capsys.readouterr().out
