"""apply_top_k_top_p_triton (threshold search, no sort) against the sampler's sort-based
masking: top-k exactly, top-p exactly except where the mass above a token is within float
rounding of p (such tokens are counted and must be rare and borderline).

On CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before Triton is
imported); scripts/gpu_check.sh runs this file compiled with SPECDEC_KERNEL_DEVICE=cuda."""
import os

DEVICE = os.environ.get("SPECDEC_KERNEL_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton; it is in the 'test' extra)")

import torch

from specdec.kernels.triton import load
from specdec.layers.sampler import _apply_top_k_top_p_sorted

kernels = load("top_k_top_p")


def reference(logits, top_k, top_p):
    k = torch.zeros(logits.shape[0], dtype=torch.int64) if top_k is None else top_k
    p = torch.ones(logits.shape[0]) if top_p is None else top_p
    return _apply_top_k_top_p_sorted(logits.clone(), k, p)


def run_kernel(logits, top_k, top_p):
    to = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return kernels.apply_top_k_top_p_triton(logits.clone().to(DEVICE), to(top_k), to(top_p)).cpu()


def borderline(logits, top_k, top_p, rows_differ):
    """For each differing (row, token): |mass strictly above the token - p| in float64."""
    gaps = []
    masked = reference(logits, top_k, None).double()  # top-k applied, as top-p sees it
    probs = masked.softmax(-1)
    for row, token in rows_differ:
        above = probs[row][masked[row] > masked[row, token]].sum()
        gaps.append(float((above - top_p[row].double()).abs()))
    return gaps


def test_top_k_only_is_exact_including_ties():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 1500, generator=gen) * 4
    logits[3] = torch.randint(-3, 4, (1500,), generator=gen).float()  # heavy ties at the k-th value
    logits[4, :700] = float("-inf")  # already masked tokens
    top_k = torch.tensor([1, 50, 0, 200, 1499])
    assert torch.equal(run_kernel(logits, top_k, None), reference(logits, top_k, None))


def test_top_p_only_and_combined_match_sort():
    gen = torch.Generator().manual_seed(1)
    num_rows, vocab_size = 12, 2000
    logits = torch.randn(num_rows, vocab_size, generator=gen) * torch.linspace(0.5, 6, num_rows)[:, None]
    top_k = torch.tensor([0, 0, 0, 10, 100, 0, 1000, 5, 0, 2000, 30, 0])
    top_p = torch.tensor([0.9, 0.5, 0.99, 1.0, 0.8, 1.0, 0.95, 0.3, 0.1, 0.7, 0.999, 0.6])
    for k in (None, top_k):
        expected = reference(logits, k, top_p)
        actual = run_kernel(logits, k, top_p)
        differ = (torch.isinf(actual) != torch.isinf(expected)).nonzero().tolist()
        assert all(gap < 1e-5 for gap in borderline(logits, k, top_p, differ)), differ
        assert len(differ) <= 2
        kept = ~torch.isinf(actual)
        torch.testing.assert_close(actual[kept], logits[kept])  # kept logits are untouched
        assert kept.sum(1).ge(1).all()


def test_rows_without_truncation_are_untouched():
    logits = torch.randn(3, 300)
    out = run_kernel(logits, torch.tensor([0, 300, -1]), torch.tensor([1.0, 1.0, 1.0]))
    assert torch.equal(out, logits)


def test_top_p_tiny_keeps_only_the_largest():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 700, generator=gen)
    out = run_kernel(logits, None, torch.tensor([1e-6, 1e-6]))
    assert torch.equal((~torch.isinf(out)).sum(1), torch.tensor([1, 1]))
    assert torch.equal(out.argmax(1), logits.argmax(1))


def test_rejects_non_float32_logits():
    with pytest.raises(ValueError, match="float32"):
        kernels.apply_top_k_top_p_triton(torch.zeros(1, 8, dtype=torch.bfloat16), torch.ones(1, dtype=torch.int64), None)
