"""Packed bf16, int8 and int4 linears against F.linear / the woq reference on the same weights."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specdec.kernels.cpu import amx_cpu, woq_cpu
from specdec.layers import cpu_kernel_choice, quantization
from specdec.layers.norm import RMSNorm
from specdec.kernels.cpu.woq_format import quantize_int4, quantize_int8, reference_linear, reference_linear_a8
from specdec.layers.quantization import (
    Bf16WeightLinear,
    Int4Linear,
    Int8Linear,
    PackedLinear,
    W4A8Linear,
    W8A8Linear,
    WeightOnlyLinear,
    _can_pack,
    prepare_for_inference,
)


@pytest.mark.parametrize("make", [Int8Linear, Int4Linear, lambda lin: Int4Linear(lin, group_size=32)])
@pytest.mark.parametrize("rows", [1, 6, 33])
def test_weight_only_linear_is_the_reference_plus_bias(make, rows):
    torch.manual_seed(0)
    lin = nn.Linear(128, 48, bias=True)
    q = make(lin)
    x = torch.randn(rows, 128)
    expected = reference_linear(x, q.quantized_weight()) + q.bias
    torch.testing.assert_close(q(x), expected, rtol=1e-5, atol=1e-5)
    # and the quantization error itself is small relative to the float layer
    assert (q(x) - lin(x)).abs().max() < 0.1 * lin(x).abs().max()


@pytest.mark.parametrize("make,int4", [(W8A8Linear, False), (W4A8Linear, True)])
def test_int8_activation_linear_is_its_reference_on_the_same_weights_plus_bias(make, int4):
    torch.manual_seed(0)
    lin = nn.Linear(576, 40, bias=True)
    q = make(lin)
    assert q.int8_activations and q.int4 == int4 and "int8 activations" in repr(q)
    # the integers are kept once, in the kernel's order; the weight comes back exactly
    names = {name for name, _ in q.named_buffers()}
    assert "a8_layout" in names and not names & {"packed", "weight_int8"}
    same = quantize_int4(lin.weight, 64) if int4 else quantize_int8(lin.weight)
    back = q.quantized_weight()
    assert all(torch.equal(getattr(back, f), getattr(same, f)) for f in
               (("packed", "scales", "offsets") if int4 else ("qweight", "scales")))
    x = torch.randn(5, 576)
    torch.testing.assert_close(q(x), reference_linear_a8(x, same) + q.bias, rtol=1e-5, atol=1e-5)
    assert (q(x) - lin(x)).abs().max() < 0.1 * lin(x).abs().max()
    # a shape the format does not take stays weight-only
    assert not W4A8Linear(nn.Linear(96, 8)).int8_activations


def test_int8_weights_round_to_within_half_a_step():
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    err = (Int8Linear(lin).dequantized_weight() - lin.weight).abs().max() / lin.weight.abs().max()
    assert err <= 0.5 / 127 + 1e-6


def test_int4_group_halves_until_it_divides_the_inputs_else_int8():
    assert Int4Linear(nn.Linear(576, 8)).quantized_weight().group_size == 64  # SmolLM2's hidden size
    q = Int4Linear(nn.Linear(80, 8))
    assert isinstance(q, WeightOnlyLinear) and not q.int4


@pytest.mark.skipif(not _can_pack(torch.bfloat16, torch.device("cpu")), reason="no oneDNN bf16 packing here")
@pytest.mark.parametrize("rows", [1, 6, 40])
def test_packed_linear_equals_f_linear(rows):
    torch.manual_seed(0)
    lin = nn.Linear(128, 96, bias=True).to(torch.bfloat16)
    x = torch.randn(rows, 128, dtype=torch.bfloat16)
    torch.testing.assert_close(PackedLinear(lin)(x).float(), F.linear(x, lin.weight, lin.bias).float(),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.skipif("not woq_cpu.available()", reason="no CPU weight kernel here")
@pytest.mark.parametrize("rows", [1, 6, 200])
def test_bf16_weight_linear_on_a_bf16_model_equals_f_linear(rows):
    torch.manual_seed(0)
    lin = nn.Linear(128, 96, bias=True).to(torch.bfloat16)
    x = torch.randn(rows, 128, dtype=torch.bfloat16)
    out = Bf16WeightLinear(lin)(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 96)
    torch.testing.assert_close(out.float(), F.linear(x, lin.weight, lin.bias).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif("not woq_cpu.available()", reason="no CPU weight kernel here")
@pytest.mark.parametrize("pairs_cpu, amx", [(True, False), (True, True), (False, False)])
def test_bf16_weight_linear_from_a_bf16_linear_takes_the_pair_kernel_only_where_the_cpu_has_bf16_dot_products(
        monkeypatch, pairs_cpu, amx):
    if pairs_cpu and not woq_cpu.bf16_pairs_available():
        pytest.skip("no avx512_bf16 here")
    if amx and not amx_cpu.available():
        pytest.skip("no AMX here")
    monkeypatch.setattr(woq_cpu, "bf16_pairs_available", lambda: pairs_cpu)
    monkeypatch.setattr(cpu_kernel_choice, "bf16_amx_faster", lambda: amx)  # the kernel measured faster
    torch.manual_seed(0)
    lin = nn.Linear(128, 96, bias=True).to(torch.bfloat16)
    layer = Bf16WeightLinear(lin)
    layer.bias.data = layer.bias.float()  # as widen_to_float32 leaves it
    assert layer.pairs == pairs_cpu
    assert torch.equal(layer.dequantized_weight(), lin.weight.float())
    for rows in (1, 6, 16, 129):
        x = torch.randn(rows, 128)
        out = layer(x)
        assert out.dtype == torch.float32 and out.shape == (rows, 96)
        if pairs_cpu:  # activations rounded to bf16, every row count through one kernel
            kernel = amx_cpu.amx_bf16_linear if amx else woq_cpu.bf16_pairs_linear
            assert torch.equal(out, kernel(x, layer.weight_bf16, layer.bias))
        else:  # float32 products, the kernel up to its row limit
            torch.testing.assert_close(out, F.linear(x, lin.weight.float(), layer.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif("not woq_cpu.available()", reason="no CPU weight kernel here")
def test_bf16_weight_linear_from_a_float32_linear_keeps_float32_products_for_every_row_count():
    torch.manual_seed(0)
    lin = nn.Linear(128, 96, bias=True).to(torch.bfloat16).float()
    layer = Bf16WeightLinear(lin)
    assert not layer.pairs and torch.equal(layer.weight_bf16.float(), lin.weight)
    decode, prefill = torch.randn(woq_cpu.BF16_KERNEL_MAX_ROWS, 128), torch.randn(woq_cpu.BF16_KERNEL_MAX_ROWS + 1, 128)
    assert torch.equal(layer(decode), woq_cpu.bf16_linear(decode, layer.weight_bf16, layer.bias))
    torch.testing.assert_close(layer(prefill), F.linear(prefill, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif("not woq_cpu.available()", reason="no CPU weight kernel here")
def test_a_bf16_model_given_bf16_weights_keeps_them_and_widens_the_rest_to_float32():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.LayerNorm(32), nn.Linear(40, 8)).to(torch.bfloat16)
    weight = model[0].weight.detach().clone()
    prepare_for_inference(model, None, torch.device("cpu"), bf16_weights="exact")
    assert isinstance(model[0], Bf16WeightLinear) and torch.equal(model[0].dequantized_weight(), weight.float())
    assert model[0].bias.dtype == torch.float32 and model[1].weight.dtype == torch.float32
    assert isinstance(model[2], nn.Linear) and model[2].weight.dtype == torch.float32  # 40 inputs: widened
    assert model[1](model[0](torch.randn(3, 64))).dtype == torch.float32


@pytest.mark.skipif(not _can_pack(torch.bfloat16, torch.device("cpu")), reason="no oneDNN bf16 packing here")
@pytest.mark.parametrize("kernel_faster", [True, False])
def test_a_bf16_model_takes_the_linear_measured_faster(monkeypatch, kernel_faster):
    monkeypatch.setattr(quantization, "bf16_kernel_faster", lambda: kernel_faster)
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(40, 8)).to(torch.bfloat16)
    prepare_for_inference(model, None, torch.device("cpu"))
    assert isinstance(model[0], Bf16WeightLinear if kernel_faster else PackedLinear)
    assert isinstance(model[1], PackedLinear)  # 40 inputs: not the kernel's shape (a multiple of 32)


def test_prepare_for_inference_int8_swaps_every_linear():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)))
    prepare_for_inference(model, "int8", torch.device("cpu"))
    assert isinstance(model[0], WeightOnlyLinear) and isinstance(model[2][0], WeightOnlyLinear)
    assert not model[0].int4


def test_prepare_for_inference_int4_keeps_the_lm_head_at_int8():
    model = nn.Module()
    model.layers = nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 128))
    model.lm_head = nn.Linear(128, 50)
    prepare_for_inference(model, "int4", torch.device("cpu"))
    assert all(layer.int4 for layer in model.layers)
    assert isinstance(model.lm_head, WeightOnlyLinear) and not model.lm_head.int4
    with pytest.raises(ValueError, match="quantization"):
        prepare_for_inference(nn.Sequential(nn.Linear(2, 2)), "int3", torch.device("cpu"))


@pytest.mark.parametrize("quantization", ["int4", "w4a8", "int8", "w8a8"])
@pytest.mark.parametrize("head", ["int8", "int4"])
def test_prepare_for_inference_gives_the_lm_head_the_asked_format(quantization, head):
    model = nn.Module()
    model.layers = nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 128))
    model.lm_head = nn.Linear(128, 50)
    prepare_for_inference(model, quantization, torch.device("cpu"), lm_head_quantization=head)
    assert all(layer.int4 == (quantization in ("int4", "w4a8")) for layer in model.layers)
    assert isinstance(model.lm_head, WeightOnlyLinear) and model.lm_head.int4 == (head == "int4")
    # the head keeps the body's activations: int8 with w8a8 / w4a8 (where the kernel takes the shape)
    assert model.lm_head.int8_activations == model.layers[0].int8_activations


def test_an_lm_head_format_without_an_integer_quantization_is_refused():
    for quantization in (None, "fp8", "int8_dynamic"):
        with pytest.raises(ValueError, match="lm_head_quantization 'int4' needs quantization one of"):
            prepare_for_inference(nn.Sequential(nn.Linear(64, 64)), quantization, torch.device("cpu"),
                                  lm_head_quantization="int4")
    with pytest.raises(ValueError, match="lm_head_quantization must be None or one of"):
        prepare_for_inference(nn.Sequential(nn.Linear(64, 64)), "int4", torch.device("cpu"), lm_head_quantization="q4")


def test_rms_norm_fused_matches_reference():
    torch.manual_seed(0)
    norm = RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32))
    x = torch.randn(5, 32)
    torch.testing.assert_close(norm(x), norm.reference(x), rtol=1e-5, atol=1e-5)
    res = torch.randn(5, 32)
    out, new_res = norm(x, res)
    torch.testing.assert_close(new_res, x + res)
    torch.testing.assert_close(out, norm.reference(x + res), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 6])
def test_dynamic_int8_linear_is_close_to_float(rows):
    from specdec.layers.quantization import DynamicInt8Linear

    torch.manual_seed(0)
    lin = nn.Linear(64, 32, bias=True)
    x = torch.randn(rows, 64)
    out, ref = DynamicInt8Linear(lin)(x), lin(x)
    # weights and activations both quantized to 8 bits: a few percent of the output scale
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()
    assert not torch.equal(out, ref)


def _tiny_mlp(bf16_values: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64, bias=False), nn.Linear(64, 20))
    if bf16_values:  # what a bf16 checkpoint loaded as float32 holds
        for lin in model:
            lin.weight.data = lin.weight.data.to(torch.bfloat16).float()
    return model


@pytest.mark.skipif("not woq_cpu.available()", reason="no AVX-512 kernel on this machine")
def test_bf16_weights_exact_keeps_only_linears_bf16_holds_and_computes_the_same():
    model = _tiny_mlp(bf16_values=True)
    model[2].weight.data[0, 0] = 1.0 + 2.0 ** -20  # not a bf16 value: this layer stays float32
    x = torch.randn(3, 64)
    with torch.no_grad():
        ref = model(x)
    prepare_for_inference(model, None, torch.device("cpu"), bf16_weights="exact")
    assert isinstance(model[0], Bf16WeightLinear) and isinstance(model[1], Bf16WeightLinear)
    assert type(model[2]) is nn.Linear
    assert model[0].weight_bf16.dtype == torch.bfloat16 and model[1].bias is None
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-6)
    rounded = prepare_for_inference(_tiny_mlp(bf16_values=False), None, torch.device("cpu"), bf16_weights="round")
    assert all(isinstance(lin, Bf16WeightLinear) for lin in rounded)
    untouched = prepare_for_inference(_tiny_mlp(bf16_values=False), None, torch.device("cpu"), bf16_weights="exact")
    assert all(type(lin) is nn.Linear for lin in untouched)


@pytest.mark.skipif("not woq_cpu.available()", reason="no CPU weight kernel here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_copied_bf16_weight_linear_multiplies_by_its_own_weight(dtype):
    import copy

    torch.manual_seed(0)
    layer = Bf16WeightLinear(nn.Linear(64, 32, bias=False, dtype=dtype))
    x = torch.randn(2, 64)
    before = layer(x)  # binds the kernel call to this weight
    twin = copy.deepcopy(layer)
    twin.weight_bf16.mul_(2)  # the copy's own weight: the original is untouched
    assert torch.equal(layer(x), before)
    assert torch.equal(twin(x), 2 * before)  # times 2 is exact in bf16 and in the float32 sums
    assert not torch.equal(twin(x), before)


@pytest.mark.parametrize("amx_rows", [None, 4])
def test_an_int8_activation_layer_switches_to_amx_at_the_measured_row_count_with_equal_rows(monkeypatch, amx_rows):
    if amx_rows is not None and amx_cpu.extension_a8() is None:
        pytest.skip("no AMX int8 here")
    if woq_cpu.extension_a8() is None:
        pytest.skip("no int8-activation kernel here")
    monkeypatch.setattr(cpu_kernel_choice, "a8_amx_min_rows", lambda int4: amx_rows)
    torch.manual_seed(0)
    layer = W4A8Linear(nn.Linear(128, 48, bias=True))
    x = torch.randn(9, 128)
    whole = layer(x)
    for i in range(9):  # each row as its own one-row call (the VNNI path when amx_rows is set)
        assert torch.equal(whole[i:i + 1], layer(x[i:i + 1]))
