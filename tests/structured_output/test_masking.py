"""The grammar mask kernels against the pure-torch reference (``unpack_row``)."""
from __future__ import annotations

import torch

from specdec.structured_output.grammar_state import GrammarState
from specdec.structured_output.masking import apply_bitmask, unpack_row


def _masks(num_rows: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    bm = GrammarState.allocate(num_rows, vocab)
    bm[0] = torch.randint(-2**31, 2**31 - 1, bm[0].shape, dtype=torch.int32, generator=g)  # half allowed
    bm[1].zero_()
    bm[1, 3] = 5  # tokens 96 and 98 only
    bm[2, 7] = 0x0F0F  # all but a few
    bm[3, -1] = 0x1  # the last word: bits past the vocabulary are ignored
    return bm


def reference(logits: torch.Tensor, bm: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    for r in rows:
        out[r] = torch.where(unpack_row(bm[r], logits.shape[1]), out[r], float("-inf"))
    return out


def test_cpu_mask_equals_reference_for_any_row_selection():
    vocab = 1000 + 7  # not a multiple of 32
    logits = torch.randn(6, vocab)
    bm = _masks(6, vocab)
    for rows in ([0, 1, 2, 3], [1, 3], [5, 0, 2]):
        got = logits.clone()
        apply_bitmask(got, bm, rows, fallback_uniform=False)
        assert torch.equal(got, reference(logits, bm, rows))


def test_argmax_only_rows_are_masked_only_when_their_argmax_is_banned():
    vocab = 256
    logits = torch.randn(3, vocab)
    bm = GrammarState.allocate(3, vocab)
    top = logits.argmax(dim=-1)
    bm[0, top[0] // 32] &= ~(1 << int(top[0] % 32))  # row 0: its argmax banned
    bm[1, (top[1] // 32 + 1) % 8] = 0  # row 1: argmax allowed, other tokens banned
    got = logits.clone()
    apply_bitmask(got, bm, [0, 1], fallback_uniform=False, argmax_only=[True, True])
    assert torch.isinf(got[0, top[0]]) and got[0].argmax() == reference(logits, bm, [0])[0].argmax()
    assert torch.equal(got[1], logits[1])  # untouched, and its argmax is the masked argmax
    assert got[1].argmax() == reference(logits, bm, [1])[1].argmax()


def test_a_row_with_no_finite_allowed_logit_becomes_uniform_over_the_allowed():
    logits = torch.full((1, 64), float("-inf"))
    logits[0, :5] = 0.0
    bm = GrammarState.allocate(1, 64)
    bm[0, 0] = 0
    bm[0, 1] = 0b11  # tokens 32 and 33 only, both -inf in the logits
    apply_bitmask(logits, bm, [0], fallback_uniform=True)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [32, 33]
