"""scripts/make_benchmarks_md.py: results grouped by the CPU kind their machine block records, each
kind with a summary of headline ratios computed from its JSON files, and every result kind in
bench_results/ read by a renderer."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
try:
    import make_benchmarks_md
finally:
    sys.path.pop(0)

ZEN4_MACHINE = {"cpu": "AMD EPYC (family 25 model 17)", "cpu_cores": 2, "torch_threads": 2,
                "cpu_flags": ["avx2", "avx512_bf16", "avx512_vnni", "avx512f"], "bandwidth_gb_per_s": 40.0}
AMX_INFO = {"vendor": "GenuineIntel", "family": 6, "model": 167, "model_name": "Intel(R) Xeon(R) Processor",
            "isa": ["avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"]}


def _shape(n: int, k: int, gbs1: float, t7: float) -> dict:
    return {"kernel": "specdec w4a8 (VNNI)", "format": "int4", "n": n, "k": k, "copy_gbs": 40.0,
            "ratio": {"1": gbs1 / 40.0, "7": 0.0}, "gb_per_s": {"1": gbs1}, "time_vs_m1": {"1": 1.0, "7": t7}}


def write_results(folder: Path) -> None:
    results = {
        # Zen 4: a peers run (2 rounds) and a kernel survey of two shapes
        "peers_zen4": {"kind": "peers", "date": "2026-12-04T10:00:00+00:00", "command": "specdec bench peers",
                       "machine": ZEN4_MACHINE, "config": {"batch_size": 0}, "goals": [], "rows": [
                           {"engine": "specdec", "config": "Q4_K_M gguf w4a8 + w4a8 draft K=5", "speculative": True,
                            "tokens_per_s_per_round": [40.0, 44.0], "median": 42.0, "mean_acceptance_length": 4.0},
                           {"engine": "llama.cpp", "config": "Q4_K_M plain", "speculative": False,
                            "tokens_per_s_per_round": [20.0, 20.0], "median": 20.0}]},
        "quant_kernels_zen4": {"kind": "quant_kernels", "date": "2026-12-04T11:00:00+00:00", "machine": ZEN4_MACHINE,
                               "rows": [1, 7], "dtype": "float32", "num_threads": 2, "group_size": 32,
                               "results": [_shape(100, 100, 10.0, 1.5), _shape(300, 100, 40.0, 1.1)]},
        # the AMX Xeon: one result with the cpu_info block, one that kept only the printed CPU line
        "roofline_amx": {"kind": "roofline", "date": "2026-12-05T04:00:00+00:00",
                         "machine": {"cpu": "Intel(R) Xeon(R) Processor (family 6 model 167)", "cpu_info": AMX_INFO,
                                     "torch_threads": 2},
                         "engines": [{"dtype": "bfloat16", "engine_dtype": "bfloat16", "decode_tokens_per_s": 9.0,
                                      "roofline_fraction": 0.9, "roofline": {"attainable_tokens_per_s": 10.0}}]},
        "moe_peer_amx": {"machine": "CPU: GenuineIntel family 6 model 167 (Intel(R) Xeon(R) Processor); ISA: avx2 "
                                    "avx512f amx_tile\n  w4a8: specdec a8", "gguf": "/m/moe-Q4_K_M.gguf",
                         "quantization": "w4a8", "threads": 2, "tokens": 128, "specdec_over_llama_cpp": 1.17,
                         "rounds": [{"specdec_tps": 22.0, "llama_cpp_tps": 18.8}],
                         "dense_1p5b_verification": {"v": {"7": 1.44}},
                         "moe_verification": {"v": {"7": 2.16}, "experts_per_layer": {"1": 8, "8": 17.5}}},
    }
    for name, data in results.items():
        (folder / f"{name}.json").write_text(json.dumps(data))
    # no machine block, and no "kind": a list of per-step records
    (folder / "step_overhead_x.json").write_text(json.dumps(
        [{"method": "none", "batch": 1, "base_outside_us": 300.0, "base_outside_cpu_us": 390.0,
          "new_outside_cpu_us": 129.0}]))
    (folder / "roofline_amx_run2.log").write_text("a log\n")


def sections(text: str) -> dict[str, str]:
    """The page's ``## `` sections by heading, table padding folded to one space."""
    return {part.split("\n", 1)[0]: re.sub(r" +", " ", part) for part in text.split("\n## ")[1:]}


def test_results_are_grouped_by_cpu_kind_with_a_summary_each(tmp_path):
    write_results(tmp_path)
    page = sections(make_benchmarks_md.build(tmp_path, tmp_path))
    zen4 = next(body for head, body in page.items() if head.startswith("AMD Zen 4"))
    amx = next(body for head, body in page.items() if head.startswith("Intel Xeon with AMX (family 6 model 167"))
    unknown = next(body for head, body in page.items() if head.startswith("unknown"))
    assert list(page).index(next(h for h in page if h.startswith("Intel"))) < list(page).index(
        next(h for h in page if h.startswith("AMD")))  # the newest kind first
    assert list(page)[-1].startswith("unknown")

    # Zen 4: the paired ratio (median of 40/20 and 44/20), and the survey's two shapes as one layer:
    # 4e4 bytes over 1000 + 750 time units = 22.9 GB/s; t(7)/t(1) = (1000 * 1.5 + 750 * 1.1) / 1750
    assert "| best lossless specdec / llama.cpp Q4_K_M plain, batch 1 | 2.10x |" in zen4
    assert "| kernel survey: specdec w4a8 (VNNI) | 22.9 GB/s; t(7)/t(1) 1.33 |" in zen4
    assert "roofline_amx" not in zen4 and "family 25 model 17 recorded (2 results)" in zen4

    # the AMX Xeon: both machine-block forms land here, with their rows
    assert '| dtype="bfloat16" decoding / roofline, batch 1 | 0.90 | 9.0 of 10.0 tok/s' in amx
    assert "| MoE GGUF plain specdec (w4a8) / llama.cpp plain (llama-bench), batch 1 | 1.17x |" in amx
    assert "| verification v(K=7) = t(8 rows) / t(1 row), MoE / dense 1.5B | 2.16 / 1.44 |" in amx
    assert "[`roofline_amx_run2.log`](roofline_amx_run2.log)" in amx and "peers_zen4" not in amx
    assert "Machine: GenuineIntel family 6 model 167" in amx

    # no machine block: "unknown", still rendered by its kind
    assert "step_overhead_x" in unknown and "none b1 390->129" in unknown


def test_links_are_relative_to_the_page(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    write_results(results)
    out = tmp_path / "docs" / "BENCHMARKS.md"
    out.parent.mkdir()
    assert make_benchmarks_md.main(["--results", str(results), "--out", str(out)]) == 0
    assert "[`peers_zen4.json`](../results/peers_zen4.json)" in out.read_text()


def test_every_recorded_result_is_read_by_its_renderer(capsys):
    """Each JSON in bench_results/ has a kind with a renderer, and that renderer reads it."""
    import benchmarks_md_kinds

    results = make_benchmarks_md.load_results(ROOT / "bench_results")
    assert results
    unread = [p.name for p, d in results if d["kind"] not in benchmarks_md_kinds.RENDERERS]
    assert not unread
    for path, data in results:
        assert benchmarks_md_kinds.headline(path.stem, data) != "see the JSON", path.name
        benchmarks_md_kinds.summary_rows(path.stem, data)
    assert "could not read" not in capsys.readouterr().err


@pytest.mark.parametrize("machine, label", [
    ({"cpu": "AMD EPYC (family 26 model 2)", "cpu_flags": ["avx512f", "avx512_bf16"]}, "AMD Zen 5"),
    ({"cpu": "AMD EPYC (Zen 5, 2 cores)"}, "AMD Zen 5"),
    ({"cpu": "AMD EPYC", "cpu_flags": ["avx2", "avx512f", "avx512_bf16"]}, "AMD EPYC with avx512_bf16, family/model"),
    ({"cpu": "Intel(R) Xeon(R) Processor @ 2.80GHz", "cpu_flags": ["avx2", "avx512f"]}, "Intel Ice Lake class"),
    ({"cpu": "AMD EPYC", "cpu_flags": ["avx2"]}, "AMD EPYC (AVX2), family/model not recorded"),
    (None, "unknown"),
])
def test_machine_kind_from_each_generation_of_machine_block(machine, label):
    import benchmarks_md_machines

    found, _ = benchmarks_md_machines.machine_kind(Path("result.json"), {"machine": machine})
    assert found.startswith(label)
