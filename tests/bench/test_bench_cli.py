"""Smoke runs of ``specdec bench ...`` on a tiny float32 model: the JSON fields exist and agree.

Timings on a tiny model mean nothing; what is checked is arithmetic that must hold whatever
the timings (fractions, bounds, efficiencies) and exact facts (replay with a = 1 accepts
everything; a = 0 nothing; greedy output never changes in float32).
"""
from __future__ import annotations

import contextlib
import io
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.bench.driver import acceptance_tap, make_prompts, timed_generate
from specdec.cli import build_parser, main

SMALL = ["--dtype", "float32", "--input-len", "8", "--output-len", "12", "--num-iters", "1", "--bandwidth-mib", "8"]
ROOT = Path(__file__).resolve().parents[2]


def run_cli(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def latency_replay(llama_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("latency")
    spec = json.dumps({"method": "replay", "acceptance": 1.0, "num_speculative_tokens": 3})
    table = run_cli(["bench", "latency", "--model", llama_path, *SMALL, "--num-iters", "2",
                     "--speculative-config", spec, "--output-json", str(folder / "latency.json"),
                     "--plot", str(folder / "latency.png")])
    return json.loads((folder / "latency.json").read_text()), folder, table


def test_latency_json_has_provenance_and_a_consistent_roofline(latency_replay):
    result, folder, table = latency_replay
    assert result["kind"] == "latency" and result["command"].startswith("specdec bench latency")
    assert result["machine"]["bandwidth_gb_per_s"] > 0 and result["machine"]["cpu_cores"] >= 1
    assert {"torch", "transformers", "specdec"} <= set(result["versions"]) and result["date"]
    roof, base = result["roofline"], result["baseline"]
    assert roof["bytes_per_step"] == pytest.approx(
        roof["weight_bytes_per_step"] + roof["kv_bytes_per_token"] * roof["mean_context_len"])
    assert roof["tokens_per_s"] == pytest.approx(roof["bandwidth_bytes_per_s"] / roof["bytes_per_step"])
    # each repetition against the bandwidth measured just before it, then the median
    per_iter = [tps / (roof["tokens_per_s"] * bw / roof["bandwidth_gb_per_s"])
                for tps, bw in zip(base["decode_tokens_per_s_per_iter"], roof["bandwidth_gb_per_s_per_iter"])]
    assert len(per_iter) == 2
    assert result["roofline_fraction"] == pytest.approx(sum(per_iter) / 2)
    assert base["num_decode_tokens"] == 12 - 1  # the first token comes out of the prefill
    assert base["prefill_s"] > 0 and base["decode_tokens_per_s"] > 0
    assert "replay K=3" in table and "roofline" in table
    assert (folder / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_latency_replay_at_full_acceptance(latency_replay):
    spec = latency_replay[0]["speculative"]
    acc = spec["acceptance"]
    assert acc["acceptance_rate"] == 1.0 and acc["alpha"] == 1.0
    assert acc["acceptance_per_position"] == [1.0, 1.0, 1.0]
    assert acc["mean_acceptance_length"] > 3.0  # 4 per step, except where max_tokens clips K
    c = spec["cost_ratio"]
    assert 0 <= c < 0.05  # replay drafts with list slicing
    assert spec["leviathan_bound"] == pytest.approx(4 / (3 * c + 1))
    assert spec["efficiency"] == pytest.approx(spec["speedup"] / spec["leviathan_bound"])
    assert spec["greedy_agreement"]["identical_fraction"] == 1.0


def test_command_line_round_trips(latency_replay):
    command = latency_replay[0]["command"]
    args = build_parser().parse_args(shlex.split(command)[1:])
    assert args.bench_command == "latency" and args.num_iters == 2 and args.output_len == 12
    assert json.loads(args.speculative_config)["method"] == "replay"


def test_latency_with_a_draft_model_measures_its_cost(llama_path, noisy_draft_path, tmp_path):
    spec = json.dumps({"method": "draft_model", "model": noisy_draft_path, "num_speculative_tokens": 2})
    run_cli(["bench", "latency", "--model", llama_path, *SMALL, "--speculative-config", spec,
             "--output-json", str(tmp_path / "r.json")])
    s = json.loads((tmp_path / "r.json").read_text())["speculative"]
    assert s["cost"]["source"] == "time_forward" and s["cost_ratio"] > 0
    assert 0 <= s["acceptance"]["alpha"] <= 1 and s["acceptance"]["num_drafts"] > 0
    assert s["greedy_agreement"]["identical_fraction"] == 1.0  # lossless in float32


def test_autok_pairs_auto_with_each_fixed_k_on_one_engine(llama_path, noisy_draft_path, tmp_path, capsys):
    spec = json.dumps({"method": "draft_model", "model": noisy_draft_path, "num_speculative_tokens": "auto",
                       "max_num_speculative_tokens": 3})
    table = run_cli(["bench", "autok", "--model", llama_path, *SMALL, "--prompts", "random", "--num-prompts", "2",
                     "--num-iters", "2", "--k-values", "1,3", "--speculative-config", spec,
                     "--output-json", str(tmp_path / "r.json")])
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["kind"] == "autok" and r["policies"] == ["auto", "1", "3"] and len(r["rounds"]) == 2
    for rnd in r["rounds"]:
        rates, mal = rnd["tokens_per_s"], rnd["mean_acceptance_length"]
        assert rnd["best_fixed_k"] in (1, 3) and rates[str(rnd["best_fixed_k"])] == max(rates["1"], rates["3"])
        assert rnd["auto_over_best_fixed"] == pytest.approx(rates["auto"] / max(rates["1"], rates["3"]))
        assert 1.0 <= mal["1"] <= 2.0 and 1.0 <= mal["3"] <= 4.0  # a fixed K accepts at most K per step
        assert rnd["auto_over_held_out_k"] > 0.0
    assert "auto / best fixed K" in table and "K=3" in table and "other half of the prompts" in table
    assert main(["bench", "autok", "--model", llama_path, *SMALL, "--k-values", "4", "--speculative-config", spec]) != 0
    assert "--k-values must be integers in [0, 3]" in capsys.readouterr().err


def test_sweep_extremes_and_plot(llama_path, tmp_path):
    table = run_cli(["bench", "sweep", "--model", llama_path, *SMALL, "--ks", "2", "--acceptances", "0.0", "1.0",
                     "--output-json", str(tmp_path / "s.json"), "--plot", str(tmp_path / "s.png")])
    result = json.loads((tmp_path / "s.json").read_text())
    cells = {c["acceptance_set"]: c for c in result["cells"]}
    assert set(cells) == {0.0, 1.0} and all(c["k"] == 2 for c in cells.values())
    none, full = cells[0.0], cells[1.0]
    assert none["acceptance"]["num_accepted_tokens"] == 0 and none["acceptance"]["alpha"] == 0.0
    assert none["acceptance"]["mean_acceptance_length"] == 1.0
    assert full["acceptance"]["alpha"] == 1.0 and full["acceptance"]["acceptance_rate"] == 1.0
    for cell in cells.values():
        assert cell["leviathan_bound"] == pytest.approx(
            (1 + 2 * (cell["acceptance"]["alpha"] == 1.0)) / (2 * cell["cost_ratio"] + 1))
        assert cell["efficiency"] == pytest.approx(cell["speedup"] / cell["leviathan_bound"])
        assert cell["greedy_agreement"]["identical_fraction"] == 1.0  # rejected drafts never change output
        assert cell["forward_cost_ratio"] > 0
        assert cell["hardware_bound"] == pytest.approx(
            (1 + 2 * (cell["acceptance"]["alpha"] == 1.0)) / (2 * cell["cost_ratio"] + cell["forward_cost_ratio"]))
        assert cell["engine_efficiency"] == pytest.approx(cell["speedup"] / cell["hardware_bound"])
    assert "efficiency vs the Leviathan bound (rows: a, columns: K)" in table
    assert "engine efficiency vs the hardware bound (rows: a, columns: K)" in table
    assert (tmp_path / "s.png").stat().st_size > 1000


def test_throughput_rows_per_batch_size(llama_path, tmp_path):
    run_cli(["bench", "throughput", "--model", llama_path, *SMALL, "--batch-sizes", "1", "3",
             "--output-json", str(tmp_path / "t.json")])
    rows = json.loads((tmp_path / "t.json").read_text())["rows"]
    assert [r["batch_size"] for r in rows] == [1, 3]
    r1, r3 = rows
    assert r3["baseline"]["num_decode_tokens"] <= 3 * 11
    # weights once per step, KV per sequence: B=3 reads less than 3 x the bytes of B=1
    assert r3["roofline"]["bytes_per_step"] < 3 * r1["roofline"]["bytes_per_step"]
    assert r3["roofline"]["tokens_per_s"] > r1["roofline"]["tokens_per_s"]


def test_compare_outputs_identical_to_transformers_in_float32(llama_path, noisy_draft_path, tmp_path):
    run_cli(["bench", "compare", "--model", llama_path, *SMALL, "--num-prompts", "2", "--draft-model",
             noisy_draft_path, "--k", "3", "--prompt-lookup-num-tokens", "4",
             "--output-json", str(tmp_path / "c.json")])
    rows = json.loads((tmp_path / "c.json").read_text())["rows"]
    names = [r["system"] for r in rows]
    assert names[0] == "transformers generate" and len(names) == 7  # incl. the int8 draft (CPU)
    for r in rows:
        assert r["agreement_with_reference"]["identical_fraction"] == 1.0, r["system"]
        assert r["tokens_per_s"] > 0


def test_acceptance_tap_sees_every_draft(llama_path):
    from specdec import LLM, SamplingParams

    llm = LLM(llama_path, dtype="float32", max_model_len=128,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    before = llm.get_metrics()
    observers = list(llm.engine.step_observers)
    prompts = make_prompts(llm, "text", 2, 24, seed=0)
    run = timed_generate(llm, prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    after = llm.get_metrics()
    assert run.acceptance.num_drafts == after["num_drafts"] - before["num_drafts"]
    assert run.acceptance.num_draft_tokens == after["num_draft_tokens"] - before["num_draft_tokens"]
    assert run.acceptance.num_accepted_tokens == after["num_accepted_tokens"] - before["num_accepted_tokens"]
    assert llm.engine.step_observers == observers  # the tap is gone afterwards
    with acceptance_tap(llm.engine) as counts:
        pass
    assert counts.num_drafts == 0


def test_benchmarks_md_is_built_from_the_json(latency_replay, tmp_path):
    result, folder, _ = latency_replay
    out = tmp_path / "BENCHMARKS.md"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_benchmarks_md.py"), "--results", str(folder),
                    "--out", str(out)], check=True, capture_output=True)
    text = out.read_text()
    assert result["command"] in text
    assert "measured copy bandwidth" in text and result["versions"]["torch"] in text and result["date"] in text
    assert "replay K=3:" in text  # the headline of the speculative engine


def test_benchmarks_md_renders_a_serve_result_without_provenance(tmp_path):
    """``bench serve`` JSON (the server engineer's format) has no machine block: say so, still tabulate."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import make_benchmarks_md
    finally:
        sys.path.pop(0)
    run = {"server": "spec", "concurrency": 2, "completed": 4, "request_throughput": 1.5, "output_throughput": 30.0,
           "ttft_ms_p50": 12.0, "itl_ms_p50": 3.0, "acceptance_rate": 0.5, "mean_acceptance_length": 2.0}
    (tmp_path / "serve.json").write_text(json.dumps({"config": {"model": "m"}, "runs": [run], "ratios": []}))
    text = make_benchmarks_md.build(tmp_path)
    assert "not recorded" in text and "spec at concurrency 2: 30.00 output tok/s" in text


def test_profile_splits_a_step_into_its_parts(llama_path, tmp_path):
    spec = json.dumps({"method": "replay", "acceptance": 1.0, "num_speculative_tokens": 3})
    out = tmp_path / "profile.json"
    table = run_cli(["bench", "profile", "--model", llama_path, "--dtype", "float32", "--input-len", "8",
                     "--steps", "4", "--num-iters", "1", "--speculative-config", spec, "--output-json", str(out),
                     "--plot", str(tmp_path / "profile.png")])
    result = json.loads(out.read_text())
    plain, replay = result["engines"]["no speculation"], result["engines"]["speculative (replay)"]
    assert plain["tokens_per_step"] == 1.0 and replay["tokens_per_step"] == 4.0  # K=3, all accepted
    for profile in (plain, replay):
        ms = profile["breakdown_ms"]
        # every labelled part was found: linears and attention inside the forward, sampling outside
        assert ms["linear"] > 0 and ms["attention"] > 0 and ms["other kernels"] > 0
        assert ms["verification + sampling"] > 0 and ms["engine Python"] > 0
        assert sum(ms.values()) == pytest.approx(profile["profiled_step_ms"])
        assert sum(profile["breakdown_fraction"].values()) == pytest.approx(1.0)
    assert replay["breakdown_ms"]["draft"] > 0
    assert "verification + sampling" in table and "step without profiler" in table
    assert (tmp_path / "profile.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_workloads_rotate_configs_and_pair_each_repetition(llama_path, tmp_path):
    """Every configuration runs every repetition (the short workloads their own count), each speedup
    is that repetition's tokens/s over the plain run of the same repetition, float32 greedy
    output is identical, and the grounded prompt really holds the function to copy."""
    from specdec.bench.workloads import grounded_prompts

    assert all("```python\ndef " in conv[0]["content"] for conv in grounded_prompts())
    table = run_cli(["bench", "workloads", "--model", llama_path, "--dtype", "float32", "--methods", "ngram",
                     "--workloads", "open", "batch", "--batch", "3", "--output-len", "12", "--k", "3",
                     "--repeats", "2", "--short-repeats", "3", "--output-json", str(tmp_path / "w.json")])
    result = json.loads((tmp_path / "w.json").read_text())
    assert result["kind"] == "workloads" and "medians of 3 interleaved runs" in table
    for wname, n in (("open", 4), ("batch", 3)):
        w = result["workloads"][wname]
        repeats = w["repeats"]
        assert (repeats, w["num_prompts"]) == (3, n)
        assert list(w["rows"]) == ["off", "ngram", "ngram-auto", "off-again"]  # with the A/A control
        assert w["rows"]["off"]["speedup_per_repeat"] == [1.0] * repeats
        for name, row in w["rows"].items():
            assert len(row["speedup_per_repeat"]) == repeats
            assert len(row["warmup_speedups"]) == 1  # the untimed first run, kept apart
            assert row["identical_outputs"] == f"{n}/{n}"
            ratios = sorted(row["speedup_per_repeat"])
            assert row["speedup"] == pytest.approx(ratios[len(ratios) // 2] if len(ratios) % 2
                                                   else (ratios[len(ratios) // 2 - 1] + ratios[len(ratios) // 2]) / 2)


def test_structured_bench_pairs_each_mode_with_its_plain_run(llama_path, tmp_path):
    """Four configurations per workload and batch: speculation on/off x free/constrained; greedy
    float32 outputs equal the plain run of the same mode; only constrained runs spend grammar time."""
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    run_cli(["bench", "structured", "--model", llama_path, "--dtype", "float32", "--speculative-config", spec,
             "--workloads", "extract", "--batch-sizes", "2", "--num-prompts", "2", "--output-len", "24",
             "--repeats", "1", "--warmup", "0", "--output-json", str(tmp_path / "s.json")])
    result = json.loads((tmp_path / "s.json").read_text())
    rows = result["batches"]["extract/2"]["rows"]
    assert list(rows) == ["off/free", "spec/free", "off/json", "spec/json"]
    for name, row in rows.items():
        assert row["identical_to_off"] and row["tokens"] > 0
        assert (row["grammar_share"] > 0) == name.endswith("json")
    assert rows["off/free"]["speedup_vs_off"] == 1.0


def test_autok_held_out_k_is_chosen_on_other_prompts_than_it_is_scored_on():
    from specdec.bench.autok import held_out_ratio

    # K=1 is fastest on prompt 0, K=3 on prompt 1, "auto" runs 8 tokens/s on both: the K picked on
    # one prompt runs 5 tokens/s on the other (in hindsight, over both: K=1, 7.5 tokens/s)
    per_prompt = {"auto": [(8, 1.0), (8, 1.0)], "1": [(10, 1.0), (5, 1.0)], "3": [(5, 1.0), (7, 0.7)]}
    assert held_out_ratio(per_prompt, ["1", "3"]) == pytest.approx(8 / 5)
    assert held_out_ratio({"auto": [(8, 1.0)], "1": [(8, 1.0)]}, ["1"]) is None
