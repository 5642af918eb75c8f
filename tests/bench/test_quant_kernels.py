"""``specdec bench quant-kernels``: a tiny run times real kernels and renders a table row each."""
import argparse

import torch

from specdec.bench import quant_kernels


def test_a_tiny_survey_times_each_kernel_against_the_copy_bandwidth(monkeypatch):
    monkeypatch.setattr(quant_kernels, "CACHE_BYTES", 1 << 20)
    monkeypatch.setattr(quant_kernels, "measure_bandwidth", lambda *a, **k: 1e10)
    names = ["specdec woq int4 (AVX-512)", "torch._weight_int8pack_mm", "dequantize + F.linear (int4)",
             "specdec bf16 pairs (AMX)", "specdec w4a8 (AMX)"]  # the AMX paths where the CPU has AMX
    names = [n for n in names if n in quant_kernels.candidate_kernels(32)]
    args = argparse.Namespace(bench_command="quant-kernels", kernels=",".join(names), shapes="64x128", rows="1,7", dtype="float32",
                              num_threads=torch.get_num_threads(), repeats=1, group_size=32, output_json=None)
    data = quant_kernels.measure(args)
    assert data["kind"] == "quant_kernels" and [r["kernel"] for r in data["results"]] == names
    for row in data["results"]:
        assert row["ratio"]["1"] > 0 and row["time_vs_m1"]["1"] == 1.0 and row["gb_per_s"]["7"] > 0
    table = quant_kernels.render(data)
    assert table.count("| 64x128 |") == len(names) and "t(M=7)/t(M=1)" in table
