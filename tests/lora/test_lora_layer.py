"""LoRALinear (batched, grouped by slot) against the row-by-row reference, over a plain, a
quantized and a fused base linear, with rows of two adapters and the base model mixed."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from specdec.layers.lora import NO_ADAPTER, LoRAContext, LoRALinear, LoRAMapping, lora_reference
from specdec.layers.quantization import Int8Linear

IN, OUTS, RANK = 32, (24, 8, 8), 4


def _weights(seed: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(rank, IN, generator=gen), torch.randn(out, rank, generator=gen)) for out in OUTS]


def _layer(base: nn.Module, slots: dict[int, list], max_loras: int = 3) -> tuple[LoRALinear, LoRAContext]:
    context = LoRAContext()
    layer = LoRALinear(base, ("q_proj", "k_proj", "v_proj"), [(0, o) for o in OUTS], (0, IN), max_loras, 8, context,
                       torch.float32, "cpu")
    for slot, parts in slots.items():
        layer.set_slot(slot, dict(zip(("q_proj", "k_proj", "v_proj"), parts)))
    return layer, context


@pytest.fixture(params=["masked", "grouped"])
def path(request, monkeypatch):
    """Both execution paths: every slot at once with a row mask (small steps), per adapter (large)."""
    if request.param == "grouped":
        monkeypatch.setattr("specdec.layers.lora.DENSE_MAX_ELEMENTS", 0)
    return request.param


@pytest.mark.parametrize("quantized", [False, True])
def test_mixed_rows_match_reference(quantized, path):
    torch.manual_seed(0)
    base = nn.Linear(IN, sum(OUTS))
    if quantized:
        base = Int8Linear(base)
    slots = {0: _weights(1, RANK), 2: _weights(2, 8)}  # different ranks; slot 1 stays empty
    layer, context = _layer(base, slots)
    request_slots, qsl = [0, NO_ADAPTER, 2, 0, 2], [0, 3, 4, 9, 10, 12]  # ragged requests
    x = torch.randn(qsl[-1], IN)
    context.mapping = LoRAMapping.build(request_slots, qsl, "cpu")
    row_slots = context.mapping.row_slots.tolist()
    got = layer(x)
    want = base(x) + lora_reference(x, row_slots, slots)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    context.mapping = None  # no mapping: the base linear alone
    torch.testing.assert_close(layer(x), base(x))


def test_one_adapter_owning_every_row_and_missing_parts(path):
    torch.manual_seed(0)
    base = nn.Linear(IN, sum(OUTS))
    a_q, b_q = _weights(3, RANK)[0]
    layer, context = _layer(base, {})
    layer.set_slot(1, {"q_proj": (a_q, b_q)})  # an adapter of q only: k and v get no delta
    x = torch.randn(5, IN)
    context.mapping = LoRAMapping.build([1, 1], [0, 2, 5], "cpu")
    assert context.mapping.groups[0][1] is None  # one group, every row: no gather
    delta = layer(x) - base(x)
    torch.testing.assert_close(delta[:, :OUTS[0]], x @ a_q.T @ b_q.T, rtol=1e-5, atol=1e-4)
    assert torch.count_nonzero(delta[:, OUTS[0]:]) == 0


def test_all_base_rows_build_no_mapping():
    assert LoRAMapping.build([NO_ADAPTER, NO_ADAPTER], [0, 2, 3], "cpu") is None


def test_emptied_slot_adds_nothing(path):
    torch.manual_seed(0)
    base = nn.Linear(IN, sum(OUTS))
    layer, context = _layer(base, {0: _weights(1, RANK)})
    layer.set_slot(0, {})
    x = torch.randn(3, IN)
    context.mapping = LoRAMapping.build([0], [0, 3], "cpu")
    torch.testing.assert_close(layer(x), base(x))


def _bf16_layer(max_loras: int = 2, rank: int = 16):
    """A LoRALinear over a pair-layout bf16 base (dtype "auto" on an avx512_bf16 CPU), or a skip."""
    from specdec.kernels.cpu import lora_cpu, woq_cpu
    from specdec.layers.quantization import Bf16WeightLinear

    if not (woq_cpu.bf16_pairs_available() and lora_cpu.available()):
        pytest.skip("no avx512_bf16 pair and LoRA kernels on this CPU")
    torch.manual_seed(0)
    outs, parts, in_features = (64, 32, 32), ("q_proj", "k_proj", "v_proj"), 64
    base = Bf16WeightLinear(nn.Linear(in_features, sum(outs), bias=False).to(torch.bfloat16))
    context = LoRAContext()
    layer = LoRALinear(base, parts, [(0, o) for o in outs], (0, in_features), max_loras, rank, context,
                       torch.float32, "cpu")
    slots = {}
    for slot in range(max_loras):
        gen = torch.Generator().manual_seed(slot + 1)
        slots[slot] = [(torch.randn(rank, in_features, generator=gen) * 0.1, torch.randn(o, rank, generator=gen) * 0.1)
                       for o in outs]
        layer.set_slot(slot, dict(zip(parts, slots[slot])))
    return layer, context, base, slots


@pytest.mark.parametrize("rank", [16, 12])  # 12: padded to the kernel's 16
def test_bf16_adapters_over_a_bf16_base_match_reference_and_are_row_consistent(rank):
    layer, context, base, slots = _bf16_layer(rank=rank)
    assert layer.bf16 and layer.add_delta is not None  # the adapters went bf16 (the LoRA kernel)
    x = torch.randn(9, 64)
    request_slots, qsl = [0, 1, NO_ADAPTER, 1], [0, 1, 5, 6, 9]
    context.mapping = LoRAMapping.build(request_slots, qsl, "cpu")
    row_slots = context.mapping.row_slots.tolist()
    got = layer(x)
    # bf16 weights and bf16-rounded activations: close to the float32 delta, not equal
    want = base(x) + lora_reference(x, row_slots, slots)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=5e-2)
    assert not torch.equal(got, base(x))
    # each row alone (a decode step) gives that row of the batch bit for bit
    for i, slot in enumerate(row_slots):
        context.mapping = LoRAMapping.build([slot], [0, 1], "cpu")
        assert torch.equal(layer(x[i:i + 1]), got[i:i + 1]), f"row {i} (slot {slot}) differs alone"
    # negative control: the float32 reference is not bitwise what the bf16 path gives
    assert not torch.equal(got, want)
