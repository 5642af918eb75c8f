"""Sampler: logits processing against hand-computed examples, penalties, seeded sampling."""
import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdec.layers import sampler
from specdec.layers.sampler import (
    SamplingMetadata,
    apply_penalties,
    processed_probs,
    sample,
    sample_from_probs,
)
from specdec.sampling_params import SamplingParams


def meta_for(*params: SamplingParams, generators=None) -> SamplingMetadata:
    return SamplingMetadata.from_params(list(params), generators or [None] * len(params), "cpu")


def logits_of(*probs_rows) -> torch.Tensor:
    return torch.tensor(probs_rows, dtype=torch.float64).log().float()


def test_from_params_flags_and_neutral_greedy_rows():
    meta = meta_for(
        SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.1),
        SamplingParams(temperature=0.7, top_k=-1, repetition_penalty=1.2),
    )
    assert meta.temperature.tolist() == pytest.approx([0.0, 0.7])
    # The greedy row's truncation settings are neutralised so it never forces a sort.
    assert meta.top_k.tolist() == [0, 0] and meta.top_p.tolist() == [1.0, 1.0] and meta.min_p.tolist() == [0, 0]
    assert (meta.all_greedy, meta.all_random) == (False, False)
    assert (meta.no_top_k, meta.no_top_p, meta.no_min_p, meta.no_penalties) == (True, True, True, False)
    random_only = meta_for(SamplingParams(temperature=1.0, top_k=3, top_p=0.9, min_p=0.05))
    assert random_only.all_random and not random_only.all_greedy
    assert (random_only.no_top_k, random_only.no_top_p, random_only.no_min_p) == (False, False, False)
    assert random_only.no_penalties
    with pytest.raises(ValueError, match="generators"):
        SamplingMetadata.from_params([SamplingParams()], [], "cpu")


def test_expand_repeats_rows_and_generators():
    g = torch.Generator().manual_seed(1)
    meta = meta_for(SamplingParams(temperature=0.5, top_k=2), SamplingParams(temperature=0.0),
                    SamplingParams(temperature=0.9), generators=[g, None, None])
    expanded = meta.expand([2, 0, 3])
    assert expanded.temperature.tolist() == pytest.approx([0.5, 0.5, 0.9, 0.9, 0.9])
    assert expanded.top_k.tolist() == [2, 2, 0, 0, 0]
    assert expanded.generators == [g, g, None, None, None]


def test_temperature():
    temperature = 2.0
    logits = torch.tensor([[math.log(4.0), math.log(2.0), 0.0]]) * temperature
    probs = processed_probs(logits, meta_for(SamplingParams(temperature=temperature)))
    torch.testing.assert_close(probs, torch.tensor([[4 / 7, 2 / 7, 1 / 7]]))


def test_top_k_per_row_and_disabled_row():
    logits = logits_of([0.4, 0.1, 0.3, 0.2], [0.4, 0.1, 0.3, 0.2])
    meta = meta_for(SamplingParams(top_k=2), SamplingParams(top_k=0))
    expected = torch.tensor([[4 / 7, 0, 3 / 7, 0], [0.4, 0.1, 0.3, 0.2]])
    torch.testing.assert_close(processed_probs(logits, meta), expected)


def test_top_k_alone_uses_topk_not_sort(monkeypatch):
    def no_sort(*args):
        raise AssertionError("top-k alone must not take the sorting path")

    monkeypatch.setattr(sampler, "_apply_top_k_top_p_sorted", no_sort)
    probs = processed_probs(logits_of([0.4, 0.1, 0.3, 0.2]), meta_for(SamplingParams(top_k=1)))
    torch.testing.assert_close(probs, torch.tensor([[1.0, 0, 0, 0]]))


def test_top_k_topk_path_equals_sort_path():
    torch.manual_seed(0)
    logits = torch.randn(6, 40)
    top_k = [1, 3, 0, 40, 55, 17]
    meta = meta_for(*(SamplingParams(top_k=k) for k in top_k))
    assert meta.no_top_p
    via_topk = processed_probs(logits, meta)
    meta.no_top_p = False  # force the sort path with top_p = 1 on every row
    via_sort = processed_probs(logits, meta)
    torch.testing.assert_close(via_topk, via_sort)
    assert (via_topk > 0).sum(dim=1).tolist() == [1, 3, 40, 40, 40, 17]


@pytest.mark.parametrize("num_candidates", [8, 64, 4096])
def test_top_p_from_a_candidate_head_equals_the_sort(num_candidates):
    """The CPU path cuts from the row's largest logits; rows the head cannot decide (top-k beyond
    it, a tie at its edge, head mass short of top-p) go through the sort. Every row must come out
    as the sort gives it: exactly the same kept set, the same values."""
    gen = torch.Generator().manual_seed(0)
    vocab = 3000
    scales = torch.tensor([0.5, 1.0, 3.0, 8.0]).repeat(12)  # flat to peaked rows
    logits = torch.randn(48, vocab, generator=gen) * scales[:, None]
    logits[5, :40] = logits[5].max() + 1.0  # a 40-way tie at the top
    logits[6, 100:200] = 0.25  # a wide tie in the middle
    top_k = torch.tensor([0, 1, 5, 50, 63, 64, 65, 700, 2999, 3000, 4000, -1] * 4)
    top_p = torch.tensor([1.0, 0.1, 0.5, 0.8, 0.9, 0.95, 0.99, 0.999, 1.0, 0.7, 0.3, 0.6] * 4)[torch.randperm(48, generator=gen)]
    via_head = sampler._apply_top_k_top_p_head(logits.clone(), top_k, top_p, num_candidates)
    via_sort = sampler._apply_top_k_top_p_sorted(logits.clone(), top_k, top_p)
    assert torch.equal(via_head.isfinite(), via_sort.isfinite())
    torch.testing.assert_close(via_head, via_sort, rtol=0, atol=0)
    kept = via_sort.isfinite().sum(dim=1)
    assert kept.min() >= 1 and (kept < vocab).sum() >= 30 and (kept > 64).sum() >= 5  # both paths exercised


def test_processed_probs_on_cpu_takes_the_head_path(monkeypatch):
    calls = []
    original = sampler._apply_top_k_top_p_head
    monkeypatch.setattr(sampler, "_apply_top_k_top_p_head", lambda *a: calls.append(1) or original(*a))
    probs = processed_probs(logits_of([0.5, 0.3, 0.15, 0.05]), meta_for(SamplingParams(top_p=0.75)))
    torch.testing.assert_close(probs, torch.tensor([[0.5 / 0.8, 0.3 / 0.8, 0, 0]]))
    assert calls == [1]


@pytest.mark.parametrize(
    "top_p, expected",
    [(0.75, [0.5 / 0.8, 0.3 / 0.8, 0, 0]), (0.9, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]), (0.3, [1.0, 0, 0, 0])],
)
def test_top_p(top_p, expected):
    # Keep the smallest set of most likely tokens whose mass reaches top_p.
    probs = processed_probs(logits_of([0.5, 0.3, 0.15, 0.05]), meta_for(SamplingParams(top_p=top_p)))
    torch.testing.assert_close(probs, torch.tensor([expected]))


@pytest.mark.parametrize(
    "min_p, expected", [(0.2, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]), (0.5, [0.5 / 0.8, 0.3 / 0.8, 0, 0])]
)
def test_min_p(min_p, expected):
    probs = processed_probs(logits_of([0.5, 0.3, 0.15, 0.05]), meta_for(SamplingParams(min_p=min_p)))
    torch.testing.assert_close(probs, torch.tensor([expected]))


def test_truncation_order_is_top_k_then_top_p_then_min_p():
    logits = logits_of([0.4, 0.3, 0.2, 0.1], [0.5, 0.3, 0.15, 0.05])
    meta = meta_for(SamplingParams(top_k=3, top_p=0.7), SamplingParams(top_p=0.82, min_p=0.2))
    # Row 0: top-3 renormalised is [4, 3, 2]/9; top-p 0.7 then drops 2/9 -> [4, 3]/7
    # (top-p first would have kept 0.2). Row 1: top-p 0.82 drops 0.05; min-p 0.2 keeps
    # 0.15 (>= 0.2 * 0.5); min-p first would have let top-p drop 0.15 as well.
    expected = torch.tensor([[4 / 7, 3 / 7, 0, 0], [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]])
    torch.testing.assert_close(processed_probs(logits, meta), expected)


def test_processed_probs_leaves_logits_untouched():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    processed_probs(logits, meta_for(*[SamplingParams(temperature=0.5, top_k=2, top_p=0.5, min_p=0.3)] * 3))
    assert torch.equal(logits, before)


def test_penalties_match_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]])
    meta = meta_for(
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(),
    )
    out = apply_penalties(logits, meta, prompt_token_ids=[[0], [0, 1]], output_token_ids=[[1, 1, 3], [3]])
    # Row 0: seen {0, 1, 3}: repetition -> [1, -2, .5, 1.5, -2]; frequency (1 twice, 3 once)
    # -> [1, -3, .5, 1, -2]; presence (1, 3) -> [1, -3.25, .5, .75, -2]. Row 1 has no penalties.
    expected = torch.tensor([[1.0, -3.25, 0.5, 0.75, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]])
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(logits, expected)  # in place


def test_penalties_skipped_when_no_row_has_any():
    logits = torch.tensor([[1.0, 2.0]])
    out = apply_penalties(logits, meta_for(SamplingParams()), [[0]], [[1, 1]])
    assert torch.equal(out, torch.tensor([[1.0, 2.0]]))


def test_greedy_rows_are_argmax():
    torch.manual_seed(0)
    logits = torch.randn(8, 30)
    params = [SamplingParams(temperature=0.0) if i % 2 == 0 else SamplingParams(temperature=1.0) for i in range(8)]
    tokens = sample(logits, meta_for(*params))
    assert torch.equal(tokens[::2], logits[::2].argmax(dim=-1))
    all_greedy = sample(logits, meta_for(*[SamplingParams(temperature=0.0)] * 8))
    assert torch.equal(all_greedy, logits.argmax(dim=-1))


def test_seeded_row_is_independent_of_the_rest_of_the_batch():
    probs = torch.softmax(torch.randn(1, 50, generator=torch.Generator().manual_seed(0)), dim=-1)

    def draws(seed: int, batch_before: int, batch_after: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        gens = [torch.Generator().manual_seed(99 + i) if i % 2 else None for i in range(batch_before)]
        gens += [g] + [None] * batch_after
        meta = meta_for(*[SamplingParams()] * len(gens), generators=gens)
        return [int(sample_from_probs(probs.expand(len(gens), -1), meta)[batch_before]) for _ in range(30)]

    alone = draws(seed=7, batch_before=0, batch_after=0)
    assert draws(seed=7, batch_before=3, batch_after=2) == alone
    assert draws(seed=7, batch_before=1, batch_after=5) == alone
    assert draws(seed=8, batch_before=0, batch_after=0) != alone


def test_sample_from_probs_distribution():
    """Chi-square goodness of fit, 100,000 draws, significance 1e-3; zero-probability tokens never drawn."""
    torch.manual_seed(1)
    probs = torch.tensor([0.3, 0.0, 0.25, 0.2, 0.1, 0.1, 0.05, 0.0])
    num_draws = 100_000
    meta = meta_for(*[SamplingParams()] * num_draws)
    counts = np.bincount(sample_from_probs(probs.expand(num_draws, -1), meta).numpy(), minlength=8)
    assert counts[probs.numpy() == 0].sum() == 0
    support = probs.numpy() > 0
    expected = probs.double().numpy()[support]
    expected *= num_draws / expected.sum()  # chisquare wants equal totals to ~1e-8
    assert chisquare(counts[support], expected).pvalue > 1e-3
