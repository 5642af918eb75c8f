"""The machine record every bench result carries."""
from specdec.bench.report import _cpu_name


def test_cpu_name_carries_family_and_model_of_the_first_processor(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n\n"
                    "processor\t: 1\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: Other\n")
    assert _cpu_name(str(info)) == "AMD EPYC (family 25 model 17)"


def test_cpu_name_without_family_is_the_model_name(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Some CPU\n")
    assert _cpu_name(str(info)) == "Some CPU"


SPR = ("processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\n"
       "model name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: fpu sse avx2 fma f16c avx512f avx512bw avx512vl "
       "avx512dq avx512_vnni avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8\n\n"
       "processor\t: 1\nvendor_id\t: Other\nflags\t\t: sse\n")
ZEN4 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC 9R14\n"
        "flags\t\t: avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_vnni avx512_bf16\n")


def test_cpu_info_gives_vendor_family_model_and_the_kernels_isa_of_the_first_processor(tmp_path):
    from specdec.worker.device import cpu_info, describe_cpu

    path = tmp_path / "cpuinfo"
    path.write_text(SPR)
    info = cpu_info(str(path))
    assert (info["vendor"], info["family"], info["model"]) == ("GenuineIntel", 6, 143)
    assert info["isa"] == ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
                           "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"]  # no fpu / sse
    assert describe_cpu(info).startswith("GenuineIntel family 6 model 143 (Intel(R) Xeon(R) Platinum 8480+); ISA: avx2")
    path.write_text(ZEN4)
    info = cpu_info(str(path))
    assert info["family"] == 25 and "amx_tile" not in info["isa"] and "avx512_bf16" in info["isa"]
    assert cpu_info(str(tmp_path / "missing")) == {"vendor": None, "family": None, "model": None,
                                                   "model_name": None, "isa": []}


def test_every_bench_run_prints_the_cpu_and_the_kernel_choices_first(monkeypatch, capsys):
    import argparse

    from specdec.bench import report

    monkeypatch.setattr(report, "cpu_kernels", lambda: {"w4a8": "specdec a8 (avx512 VNNI), AMX tiles from 16 rows"})
    order = []
    args = argparse.Namespace(device="cpu", output_json=None, bench_command="quant-kernels")
    report.run_benchmark(args, lambda a: order.append("measure") or {}, lambda r: "table")
    out = capsys.readouterr().out
    assert out.startswith("CPU: ") and "w4a8: specdec a8 (avx512 VNNI), AMX tiles from 16 rows" in out
    assert out.index("w4a8") < out.index("table") and order == ["measure"]


def test_the_machine_record_carries_the_cpu_and_on_cpu_the_kernel_choices(monkeypatch):
    import torch

    from specdec.bench import report

    monkeypatch.setattr(report, "cpu_kernels", lambda: {"attention": "torch SDPA"})
    cpu = report.machine_info(None, torch.device("cpu"))
    assert cpu["cpu_info"]["isa"] == report.cpu_info()["isa"] and cpu["cpu_kernels"] == {"attention": "torch SDPA"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "a GPU")
    assert "cpu_kernels" not in report.machine_info(None, torch.device("cuda"))
