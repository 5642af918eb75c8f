"""The kernel choices measured at load time: the decision rules on given timings (as another CPU kind
would measure them), the measured choices on this machine, and the report ``specdec bench`` prints."""
import pytest

from specdec.kernels.cpu import amx_cpu, woq_cpu
from specdec.layers import cpu_kernel_choice


def test_pick_row_kernel_takes_the_fastest_verification_among_kernels_near_the_fastest_decode():
    pick = cpu_kernel_choice.pick_row_kernel
    rows = cpu_kernel_choice.VERIFY_ROWS
    # AMX 5% slower at one row, 1.5x faster at a verification: within the 10% tolerance, taken
    assert pick({"avx512_bf16": {1: 1.00, rows: 1.50}, "amx": {1: 1.05, rows: 1.02}}) == "amx"
    # 20% slower at one row: plain decoding would pay for it, not taken however fast it verifies
    assert pick({"avx512_bf16": {1: 1.00, rows: 1.50}, "amx": {1: 1.20, rows: 1.02}}) == "avx512_bf16"
    # both near at one row: the faster verification wins, whichever is first
    assert pick({"amx": {1: 1.00, rows: 1.60}, "avx512_bf16": {1: 1.02, rows: 1.40}}) == "avx512_bf16"


def test_bf16_amx_is_never_chosen_where_the_amx_kernel_cannot_run(monkeypatch):
    monkeypatch.setattr(amx_cpu, "available", lambda: False)
    cpu_kernel_choice.bf16_amx_times.cache_clear()
    cpu_kernel_choice.bf16_amx_faster.cache_clear()
    try:
        assert cpu_kernel_choice.bf16_amx_times() is None and not cpu_kernel_choice.bf16_amx_faster()
    finally:
        cpu_kernel_choice.bf16_amx_times.cache_clear()
        cpu_kernel_choice.bf16_amx_faster.cache_clear()


@pytest.mark.skipif(not (amx_cpu.available() and woq_cpu.bf16_pairs_available()), reason="no AMX here")
def test_bf16_amx_choice_is_measured_from_both_kernels_timings():
    times = cpu_kernel_choice.bf16_amx_times()
    assert set(times) == {"avx512_bf16", "amx"}
    assert all(t[1] > 0 and t[cpu_kernel_choice.VERIFY_ROWS] > 0 for t in times.values())
    assert cpu_kernel_choice.bf16_amx_faster() == (cpu_kernel_choice.pick_row_kernel(times) == "amx")


def test_min_rows_faster_is_a_threshold_above_which_the_fast_kernel_always_wins():
    pick = cpu_kernel_choice.min_rows_faster
    t = {"vnni": {1: 1.0, 2: 1.0, 4: 1.1, 8: 1.4, 16: 2.8}, "amx": {1: 1.6, 2: 1.6, 4: 1.6, 8: 1.7, 16: 1.8}}
    assert pick(t, "amx", "vnni") == 16
    t["amx"][8] = 1.3
    assert pick(t, "amx", "vnni") == 8
    t["amx"][2] = 0.9  # a lone faster point below a slower one is noise, not a threshold
    assert pick(t, "amx", "vnni") == 8
    t["amx"][16] = 3.0  # slower at the most rows: never
    assert pick(t, "amx", "vnni") is None
    t["amx"][16] = 2.7  # 4% faster: within the margin, a tie
    assert pick(t, "amx", "vnni") is None


@pytest.mark.skipif(woq_cpu.extension_a8() is None or not woq_cpu.bf16_pairs_available(),
                    reason="needs the int8-activation kernel and avx512_bf16")
def test_the_report_names_the_kernel_each_format_runs_from_the_measured_choices(monkeypatch):
    from specdec.layers import quantization

    monkeypatch.setattr(cpu_kernel_choice, "a8_amx_min_rows", lambda int4: 16 if int4 else None)
    monkeypatch.setattr(cpu_kernel_choice, "bf16_amx_faster", lambda: True)
    monkeypatch.setattr(quantization, "bf16_kernel_faster", lambda: True)
    choices = cpu_kernel_choice.cpu_kernel_choices()
    assert choices["w4a8"].endswith("AMX tiles from 16 rows") and "AMX tiles from" not in choices["w8a8"]
    assert choices['dtype="bfloat16"'] == "bf16 weights, float32 activations: AMX tiles (pair layout)"
    assert choices['dtype="auto", no quantization'] == "bf16 weights, float32 activations: AMX tiles (pair layout)"
    monkeypatch.setattr(cpu_kernel_choice, "bf16_amx_faster", lambda: False)
    monkeypatch.setattr(quantization, "bf16_kernel_faster", lambda: False)
    choices = cpu_kernel_choice.cpu_kernel_choices()
    assert choices['dtype="bfloat16"'].startswith("bfloat16 model: oneDNN packed")
