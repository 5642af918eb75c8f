"""The bf16 multi-adapter LoRA kernel (``lora_cpu.lora_bf16_add_``) against its pure-torch reference, on
CPUs with avx512_bf16.

Tolerance: both round x and ``xa = A x`` to bf16 and sum bf16 x bf16 products (exact in float32) in float32,
in different orders, so a float32 ``xa`` may round to the neighbouring bf16 value (at most one bf16 ulp,
2^-7 |xa|, apart). The bound per output is that, carried through B, plus the float32 sum bound
(K + 2) * 2^-24 * sum |products| for both sums (Higham 3.1). Row independence is asserted bit for bit.
"""
import pytest
import torch

from specdec.kernels.cpu import lora_cpu

needs_kernel = pytest.mark.skipif("not lora_cpu.available()", reason="no avx512_bf16 LoRA kernel on this CPU")

PARTS = [32, 16, 48]


def _case(num_slots: int = 3, rank: int = 12, k: int = 70, seed: int = 0):
    """Packed adapters of ``num_slots`` slots (rank ``rank``, padded) and the float32 weights they round."""
    g = torch.Generator().manual_seed(seed)
    padded = lora_cpu.padded_rank(rank)
    a_rows, b_rows, weights = [], [], {}
    for slot in range(num_slots):
        weights[slot] = [(torch.randn(rank, k, generator=g) * 0.2, torch.randn(n, rank, generator=g) * 0.2)
                         for n in PARTS]
    for p in range(len(PARTS)):
        for slot in range(num_slots):
            a_rows.append(lora_cpu.pack_a(weights[slot][p][0], padded))
    for slot in range(num_slots):
        b_rows.append(lora_cpu.pack_b([b for _, b in weights[slot]], padded))
    return torch.cat(a_rows), torch.cat(b_rows), weights


def _bound(x: torch.Tensor, row_slots: list[int], weights) -> torch.Tensor:
    """Per output, how far two correct results may lie apart (module doc), from the bf16-rounded weights."""
    rows = []
    xb = x.to(torch.bfloat16).double()
    for m, slot in enumerate(row_slots):
        if slot < 0:
            rows.append(torch.zeros(sum(PARTS), dtype=torch.float64))
            continue
        parts = []
        for a, b in weights[slot]:
            a, b = a.to(torch.bfloat16).double(), b.to(torch.bfloat16).double()
            xa_abs = a.abs() @ xb[m].abs()  # [r]: bounds |xa| and its float32 sum's terms
            k = a.shape[1]
            xa_err = 2.0 ** -7 * xa_abs + 2 * (k + 2) * 2.0 ** -24 * xa_abs
            parts.append(b.abs() @ xa_err * 1.01 + 2 * (b.shape[1] + 2) * 2.0 ** -24 * (b.abs() @ xa_abs) * 1.02)
        rows.append(torch.cat(parts))
    return torch.stack(rows) + 1e-6  # plus the final add into out (float32 ulps of |out| <= 8)


@needs_kernel
@pytest.mark.parametrize("rank, k", [(12, 70), (16, 64), (32, 96)])
def test_kernel_matches_the_reference_within_the_rounding_bound(rank, k):
    a, b, weights = _case(rank=rank, k=k)
    row_slots = [0, 2, -1, 2, 1, 2, 2, 2, 0, -1, 2]  # slot 2: 6 rows, more than one tile of rows
    x = torch.randn(len(row_slots), k) * 2
    base = torch.randn(len(row_slots), sum(PARTS))
    slots = torch.tensor(row_slots)
    got = lora_cpu.lora_bf16_add_(base.clone(), x, a, b, slots, 3, PARTS)
    want = lora_cpu.reference_lora_bf16_add_(base.clone(), x, a, b, slots, 3, PARTS)
    assert (got.double() - want.double()).abs().le(_bound(x, row_slots, weights)).all()
    for m, slot in enumerate(row_slots):  # rows without an adapter are left as they were, bit for bit
        assert torch.equal(got[m], base[m]) == (slot < 0)
    # negative control: the rows' slots matter (another assignment is far outside the bound)
    other = lora_cpu.lora_bf16_add_(base.clone(), x, a, b, slots.roll(1), 3, PARTS)
    assert not (other.double() - want.double()).abs().le(_bound(x, row_slots, weights)).all()


@needs_kernel
def test_a_row_is_the_same_alone_and_in_any_batch_bitwise():
    a, b, _ = _case(rank=16, k=64)
    row_slots = torch.tensor([1, 0, 1, 1, -1, 2, 1, 1, 0, 1, 2])
    x = torch.randn(len(row_slots), 64)
    base = torch.randn(len(row_slots), sum(PARTS))
    whole = lora_cpu.lora_bf16_add_(base.clone(), x, a, b, row_slots, 3, PARTS)
    for m in range(len(row_slots)):
        alone = lora_cpu.lora_bf16_add_(base[m:m + 1].clone(), x[m:m + 1], a, b, row_slots[m:m + 1], 3, PARTS)
        assert torch.equal(alone, whole[m:m + 1]), f"row {m} differs alone"
    order = torch.randperm(len(row_slots), generator=torch.Generator().manual_seed(1))
    shuffled = lora_cpu.lora_bf16_add_(base[order].clone(), x[order], a, b, row_slots[order], 3, PARTS)
    assert torch.equal(shuffled, whole[order])


@needs_kernel
def test_bf16_rows_and_a_bf16_output_take_the_same_values():
    a, b, _ = _case(rank=16, k=64)
    row_slots = torch.tensor([0, 1, 2])
    x = torch.randn(3, 64).to(torch.bfloat16)
    out = torch.zeros(3, sum(PARTS))
    want = lora_cpu.lora_bf16_add_(out, x.float(), a, b, row_slots, 3, PARTS)
    got = lora_cpu.lora_bf16_add_(torch.zeros(3, sum(PARTS), dtype=torch.bfloat16), x, a, b, row_slots, 3, PARTS)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))


@needs_kernel
def test_bad_inputs_name_the_argument():
    a, b, _ = _case(rank=16, k=64)
    x, out = torch.randn(2, 64), torch.zeros(2, sum(PARTS))
    with pytest.raises(RuntimeError, match="row 1 has slot 3"):
        lora_cpu.lora_bf16_add_(out, x, a, b, torch.tensor([0, 3]), 3, PARTS)
    with pytest.raises(RuntimeError, match="row_slots"):
        lora_cpu.lora_bf16_add_(out, x, a, b, torch.tensor([0]), 3, PARTS)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        lora_cpu.lora_bf16_add_(out, x, a, b, torch.tensor([0, 1]), 3, [40, 8, 48])


def test_reference_adds_each_row_its_own_slot_delta():
    """The reference against the float32 product written out (runs on every CPU)."""
    a, b, weights = _case(rank=16, k=64)
    x = torch.randn(3, 64)
    out = lora_cpu.reference_lora_bf16_add_(torch.zeros(3, sum(PARTS)), x, a, b, torch.tensor([2, -1, 0]), 3, PARTS)
    for m, slot in [(0, 2), (2, 0)]:
        want = torch.cat([b_p @ (a_p @ x[m]) for a_p, b_p in weights[slot]])
        torch.testing.assert_close(out[m], want, rtol=3e-2, atol=3e-2)
    assert torch.count_nonzero(out[1]) == 0
