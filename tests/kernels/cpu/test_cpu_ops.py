"""The fused float32 CPU ops (specdec.kernels.cpu.cpu_ops) against their torch forms."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec.kernels.cpu import cpu_ops
from specdec.layers.norm import RMSNorm
from specdec.layers.rotary import RotaryEmbedding, rotate, rotate_reference

pytestmark = pytest.mark.skipif("cpu_ops.extension() is None", reason="the fused CPU ops did not build here")


@pytest.mark.parametrize("rows,n", [(1, 64), (7, 576), (33, 1536)])
def test_norms_match_torch(rows, n):
    g = torch.Generator().manual_seed(rows)
    x, r, w = torch.randn(rows, n, generator=g), torch.randn(rows, n, generator=g), torch.randn(n, generator=g)
    out, summed = cpu_ops.extension().add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(summed, x + r)
    torch.testing.assert_close(out, F.rms_norm(x + r, (n,), w, 1e-6), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cpu_ops.extension().rms_norm(x, w, 1e-6), F.rms_norm(x, (n,), w, 1e-6),
                               rtol=1e-5, atol=1e-5)


def test_rotate_matches_torch_on_strided_rows():
    rope = RotaryEmbedding(64, 128, 10000.0)
    positions = torch.tensor([0, 3, 17, 127])
    cos, sin = rope.lookup(positions)
    qkv = torch.randn(4, (6 + 2 * 2) * 64)  # q: 6 heads, k and v: 2: qk is a strided view, as in Attention
    qk = qkv[:, : 8 * 64].view(4, 8, 64)
    assert not qk.is_contiguous()
    torch.testing.assert_close(rotate(qk, cos, sin), rotate_reference(qk, cos, sin), rtol=1e-6, atol=1e-6)


def test_a_rows_result_does_not_depend_on_its_batch():
    g = torch.Generator().manual_seed(0)
    x, r, w = torch.randn(9, 256, generator=g), torch.randn(9, 256, generator=g), torch.randn(256, generator=g)
    batched, _ = cpu_ops.extension().add_rms_norm(x, r, w, 1e-5)
    for i in range(9):
        alone, _ = cpu_ops.extension().add_rms_norm(x[i:i + 1], r[i:i + 1], w, 1e-5)
        assert torch.equal(alone[0], batched[i])


def test_module_uses_torch_for_gradients_and_other_dtypes(monkeypatch):
    norm = RMSNorm(32)
    x = torch.randn(3, 32, requires_grad=True)
    norm(x).sum().backward()  # the fused op has no backward: the torch form must have run
    assert x.grad is not None
    called = []
    monkeypatch.setattr(cpu_ops, "extension", lambda: called.append(1) or None)
    norm(torch.randn(3, 32, dtype=torch.bfloat16).requires_grad_(False)).float()
    assert not called  # bf16 never asks for the fused ops


@pytest.mark.parametrize("rows,n", [(1, 4864), (6, 8960), (3, 37)])
def test_silu_mul_matches_torch_and_rows_do_not_depend_on_their_batch(rows, n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(rows, 2 * n, generator=g) * 6  # gates far into both tails of the sigmoid
    out = cpu_ops.extension().silu_mul(x)
    torch.testing.assert_close(out, F.silu(x[:, :n]) * x[:, n:], rtol=2e-6, atol=1e-6)
    for i in range(rows):
        assert torch.equal(cpu_ops.extension().silu_mul(x[i:i + 1]), out[i:i + 1])
