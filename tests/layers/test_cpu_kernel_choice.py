"""The kernel choices measured at load time: the decision rules on given timings (as another CPU kind
would measure them), the measured choices on this machine, and the report ``specdec bench`` prints."""
import pytest

from specdec.kernels.cpu import amx_cpu, woq_a8_variants, woq_cpu
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


@pytest.mark.skipif("not (amx_cpu.available() and woq_cpu.bf16_pairs_available())", reason="no AMX here")
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


@pytest.mark.skipif("woq_cpu.extension_a8() is None or not woq_cpu.bf16_pairs_available()",
                    reason="needs the int8-activation kernel and avx512_bf16")
def test_the_report_names_the_kernel_each_format_runs_from_the_measured_choices(monkeypatch):
    from specdec.layers import quantization

    monkeypatch.setattr(cpu_kernel_choice, "a8_amx_min_rows", lambda int4: 16 if int4 else None)
    monkeypatch.delenv(woq_a8_variants.FORCE_ENV, raising=False)
    monkeypatch.setattr(cpu_kernel_choice, "a8_measured_plan",
                        lambda int4: {m: "vnni512" if m < 4 or not int4 else "bf16"
                                      for m in cpu_kernel_choice.A8_VARIANT_ROWS})
    monkeypatch.setattr(cpu_kernel_choice, "bf16_amx_faster", lambda: True)
    monkeypatch.setattr(quantization, "bf16_kernel_faster", lambda: True)
    choices = cpu_kernel_choice.cpu_kernel_choices()
    assert choices["w4a8"].endswith(": vnni512 at 1-2, bf16 at 4-64 rows, AMX tiles from 16 rows")
    assert choices["w8a8"].endswith(": vnni512 at 1-64 rows") or choices["w8a8"].endswith("AMX measured slower")
    assert "AMX tiles from" not in choices["w8a8"]
    assert choices['dtype="bfloat16"'] == "bf16 weights, float32 activations: AMX tiles (pair layout)"
    assert choices['dtype="auto", no quantization'] == "bf16 weights, float32 activations: AMX tiles (pair layout)"
    monkeypatch.setattr(cpu_kernel_choice, "bf16_amx_faster", lambda: False)
    monkeypatch.setattr(quantization, "bf16_kernel_faster", lambda: False)
    choices = cpu_kernel_choice.cpu_kernel_choices()
    assert choices['dtype="bfloat16"'].startswith("bfloat16 model: oneDNN packed")


def test_pick_per_rows_takes_the_fastest_kernel_at_each_row_count_and_keeps_the_default_on_a_near_tie():
    pick = cpu_kernel_choice.pick_per_rows
    t = {"vnni512": {1: 1.0, 4: 2.0, 8: 3.0}, "vnni256": {1: 1.5, 4: 1.5, 8: 2.0}, "bf16": {1: 2.0, 4: 1.9, 8: 1.0}}
    assert pick(t, "vnni512") == {1: "vnni512", 4: "vnni256", 8: "bf16"}
    t["vnni256"][1] = 0.98  # 2% faster: within the 3% margin, the default stays
    assert pick(t, "vnni512")[1] == "vnni512"
    t["vnni256"][1] = 0.95
    assert pick(t, "vnni512")[1] == "vnni256"


@pytest.fixture
def fake_a8_variants(monkeypatch):
    """Two variants whose calls advance a fake clock: ``vnni512`` by 1 + rows, ``vnni256`` by 4; the
    load-time measurement then runs on that clock."""
    clock = [0.0]

    def fake(cost):
        def op(x, *args):
            clock[0] += cost(x.shape[0])
        return op

    ops = {"vnni512": fake(lambda m: 1.0 + m), "vnni256": fake(lambda m: 4.0)}
    monkeypatch.setattr(woq_a8_variants, "variant_ops",
                        lambda int4, amx=True: {name: op for name, op in ops.items() if amx or name != "amx"})
    monkeypatch.setattr(woq_a8_variants, "default_variant", lambda: "vnni512")
    monkeypatch.setattr(cpu_kernel_choice, "a8_timing_weights", lambda int4: [(), ()])
    monkeypatch.setattr(cpu_kernel_choice, "a8_amx_min_rows", lambda int4: None)
    monkeypatch.setattr(cpu_kernel_choice.time, "perf_counter", lambda: clock[0])
    monkeypatch.delenv(woq_a8_variants.FORCE_ENV, raising=False)
    cpu_kernel_choice.clear_a8_timings()
    yield ops
    cpu_kernel_choice.clear_a8_timings()


def test_the_load_time_plan_runs_the_faster_of_two_fake_timed_variants_at_each_row_count(fake_a8_variants):
    ops = fake_a8_variants
    plan = cpu_kernel_choice.a8_variant_plan(True)
    # 1 + m against 4: the default at 1 and 2 rows, vnni256 from 4 rows (4 < 0.97 * 5)
    assert plan == {m: "vnni512" if m <= 2 else "vnni256" for m in cpu_kernel_choice.A8_VARIANT_ROWS}
    by_rows = cpu_kernel_choice.a8_row_ops(True)
    last = cpu_kernel_choice.A8_VARIANT_ROWS[-1]
    assert len(by_rows) == last + 1 and by_rows[0] is by_rows[1] is by_rows[2] is ops["vnni512"]
    assert all(by_rows[m] is ops["vnni256"] for m in range(3, last + 1))  # 3 rows: the 4-row choice; 9-16: the 16-row
    assert f"vnni512 at 1-2, vnni256 at 4-{last} rows" == cpu_kernel_choice.describe_plan(plan)


def test_amx_takes_the_row_counts_from_its_threshold_and_the_variable_forces_one_variant(fake_a8_variants,
                                                                                         monkeypatch):
    fake_a8_variants["amx"] = lambda x, *args: None
    monkeypatch.setattr(cpu_kernel_choice, "a8_amx_min_rows", lambda int4: 8)
    plan = cpu_kernel_choice.a8_variant_plan(True)
    assert plan[6] == "vnni256" and plan[8] == plan[16] == "amx"
    monkeypatch.setenv(woq_a8_variants.FORCE_ENV, "vnni256")
    assert set(cpu_kernel_choice.a8_variant_plan(True).values()) == {"vnni256"}
    monkeypatch.setenv(woq_a8_variants.FORCE_ENV, "bf16")  # not among this format's variants: the default
    assert set(cpu_kernel_choice.a8_variant_plan(False).values()) == {"vnni512"}


@pytest.mark.skipif("woq_cpu.extension_a8() is None", reason="no int8-activation kernel here")
@pytest.mark.parametrize("int4", [True, False])
def test_a_layer_mixing_variants_by_row_count_gives_each_row_its_one_row_value(monkeypatch, int4):
    import torch
    from torch import nn

    from specdec.layers.quantization import W4A8Linear, W8A8Linear

    names = list(woq_a8_variants.variant_ops(int4))
    plan = {m: names[i % len(names)] for i, m in enumerate(cpu_kernel_choice.A8_VARIANT_ROWS)}
    monkeypatch.setattr(cpu_kernel_choice, "a8_variant_plan", lambda fmt_int4: plan)
    torch.manual_seed(0)
    layer = (W4A8Linear if int4 else W8A8Linear)(nn.Linear(256, 48, bias=True))
    x = torch.randn(20, 256)
    whole = layer(x)
    for m in range(1, 20):  # every row count runs its own variant; each row is the same
        assert torch.equal(layer(x[:m]), whole[:m]), m
    for i in range(20):
        assert torch.equal(layer(x[i:i + 1]), whole[i:i + 1]), i
