"""``specdec.kernels.cpu.prebuild``: which kernels it builds on a CPU, in what order, how many at once,
and that a stop or a failing loader ends nothing else. Loader calls are stand-ins: nothing is compiled."""
import threading

import pytest

from specdec.kernels.cpu import amx_cpu, cpp_build, lora_cpu, prebuild, woq_cpu

AVX512 = woq_cpu.ISAS["avx512"][1]
AVX2 = woq_cpu.ISAS["avx2"][1]


def labels_on(monkeypatch, flags) -> list[str]:
    monkeypatch.setattr(cpp_build, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.delenv(lora_cpu.DISABLE_ENV, raising=False)
    return [label for label, _ in prebuild.targets()]


def test_an_amx_cpu_builds_every_kernel_for_both_instruction_sets_dependencies_first(monkeypatch):
    labels = labels_on(monkeypatch, AVX512 + AVX2 + woq_cpu.A8_EXTRA["avx512"][1] + amx_cpu.A8_NEEDS + lora_cpu.NEEDS)
    assert labels == ["cpu_ops", "woq avx512", "attention_rows avx512", "woq_a8 avx512", "amx", "woq_a8 amx", "lora",
                      "moe avx512", "woq avx2", "attention_rows avx2", "woq_a8 avx2", "moe avx2"]


def test_an_avx2_cpu_builds_only_what_it_runs(monkeypatch):
    assert labels_on(monkeypatch, AVX2) == ["cpu_ops", "woq avx2", "attention_rows avx2", "woq_a8 avx2", "moe avx2"]
    # AVX-512 without VNNI: the int8-activation kernels (and the MoE one on them) only in their AVX2 form
    labels = labels_on(monkeypatch, AVX512 + AVX2)
    assert "woq_a8 avx512" not in labels and "moe avx512" not in labels and "woq_a8 avx2" in labels


def test_jobs_run_at_once_and_a_failing_loader_stops_nothing_else():
    both_running = threading.Barrier(2, timeout=10)

    def meets():
        both_running.wait()  # only returns once the other job runs too
        return object()

    def fails():
        raise ValueError("SPECDEC_CPU_ISA='neon'")

    done = prebuild.build_all([("a", meets), ("b", meets), ("c", fails), ("d", lambda: None), ("e", object)], jobs=2)
    assert done == {"a": True, "b": True, "c": False, "d": False, "e": True}


def test_a_stop_starts_no_further_build():
    stop = threading.Event()
    ran = []

    def first():
        ran.append("first")
        stop.set()
        return object()

    done = prebuild.build_all([("first", first), ("second", lambda: ran.append("second"))], jobs=1, stop=stop)
    assert ran == ["first"] and done == {"first": True}


def test_jobs_below_one_is_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        prebuild.main(["--jobs", "0"])
    assert "--jobs must be >= 1, got 0" in capsys.readouterr().err
