"""Rejection sampler: exact greedy cases, statistical losslessness (with a negative control),
and mixed batches equal to per-request calls."""
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdec.layers.sampler import SamplingMetadata, processed_probs
from specdec.sampling_params import SamplingParams
from specdec.spec_decode import rejection_sampler
from specdec.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID, rejection_sample

ALPHA = 1e-3  # significance level of every statistical assertion below
NUM_DRAWS = 200_000  # requests per statistical run, one rejection_sample call each


def meta_for(params: list[SamplingParams], generators=None) -> SamplingMetadata:
    return SamplingMetadata.from_params(params, generators or [None] * len(params), "cpu")


def peaked_logits(argmax_tokens: list[int], vocab_size: int) -> torch.Tensor:
    logits = torch.linspace(-1.0, 0.0, vocab_size).repeat(len(argmax_tokens), 1)  # ascending, max 0
    logits[torch.arange(len(argmax_tokens)), argmax_tokens] = 5.0
    return logits


# ---------------------------------------------------------------- greedy, exact


def greedy(num_requests: int) -> SamplingMetadata:
    return meta_for([SamplingParams(temperature=0.0)] * num_requests)


def test_greedy_all_accepted_then_bonus():
    logits = peaked_logits([2, 5, 1, 7], vocab_size=8)
    out, num_accepted = rejection_sample(logits, torch.tensor([2, 5, 1]), [3], None, greedy(1))
    assert out.tolist() == [[2, 5, 1, 7]] and num_accepted.tolist() == [3]


def test_greedy_first_mismatch_is_recovered_and_stops():
    logits = peaked_logits([2, 5, 1, 7], vocab_size=8)
    out, num_accepted = rejection_sample(logits, torch.tensor([2, 4, 1]), [3], None, greedy(1))
    # Draft 1 (4) != argmax (5): recovered 5, and the later (matching) draft 1 is not emitted.
    assert out.tolist() == [[2, 5, PLACEHOLDER_TOKEN_ID, PLACEHOLDER_TOKEN_ID]]
    assert num_accepted.tolist() == [1]


def test_greedy_k0_emits_argmax():
    out, num_accepted = rejection_sample(peaked_logits([6], 8), torch.empty(0, dtype=torch.int64), [0], None, greedy(1))
    assert out.tolist() == [[6]] and num_accepted.tolist() == [0]


def test_greedy_ragged_batch_without_any_softmax_or_sort(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("an all-greedy batch must only take argmax")

    for name in ("processed_probs", "sample_from_probs"):
        monkeypatch.setattr(rejection_sampler, name, forbidden)
    for name in ("softmax", "sort", "topk"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    logits = peaked_logits([3, 6, 1, 2, 5, 5, 0, 4], vocab_size=8)  # rows: request 0 (K=0), 1 (K=2), 2 (K=3)
    drafts = torch.tensor([0, 1, 5, 5, 4])
    draft_probs = torch.full((5, 8), 1 / 8)  # ignored for greedy requests
    out, num_accepted = rejection_sample(logits, drafts, [0, 2, 3], draft_probs, greedy(3))
    assert out.tolist() == [[3, -1, -1, -1], [6, -1, -1, -1], [5, 5, 0, -1]]
    assert num_accepted.tolist() == [0, 0, 2]


def test_argmax_verification_equals_the_greedy_rejection_sampler():
    """ChainVerifier.verify_argmax (greedy requests without logits processing) emits what the
    rejection sampler's greedy rule emits, request by request, on ragged batches where drafts
    match the argmax for random prefixes."""
    from specdec.spec_decode.proposer import DraftProposal
    from specdec.spec_decode.verifier import ChainVerifier

    verifier = ChainVerifier(rejection_sample)
    gen = torch.Generator().manual_seed(0)
    num_differing = 0
    for _ in range(50):
        ks = torch.randint(0, 4, (6,), generator=gen).tolist()
        logits = torch.randn(sum(ks) + len(ks), 12, generator=gen)
        argmax, drafts, row = logits.argmax(-1).tolist(), [], 0
        for k in ks:
            matching = int(torch.randint(0, k + 1, (1,), generator=gen))
            wrong = [(argmax[row + j] + 1) % 12 for j in range(matching, k)]
            drafts.append(argmax[row:row + matching] + wrong)
            row += k + 1
        proposal = DraftProposal(drafts, None)
        verified = list(range(len(ks)))
        fast = verifier.verify_argmax(logits, proposal, verified)
        reference = verifier.verify(logits, proposal, verified, greedy(len(ks)))
        assert fast == reference
        num_differing += sum(a < len(d) for a, d in zip(fast.num_accepted, drafts))
    assert num_differing > 0  # rejections were exercised, not only full acceptance


def test_mismatched_shapes_raise():
    with pytest.raises(ValueError, match="num_draft_tokens"):
        rejection_sample(torch.zeros(3, 4), torch.tensor([1, 2]), [1], None, greedy(1))


# ---------------------------------------------------------------- random, exact corner cases


def test_draft_equal_to_target_is_always_accepted():
    torch.manual_seed(0)
    logits = torch.randn(4, 20)
    params = SamplingParams(temperature=0.8, top_k=10)
    p = processed_probs(logits, meta_for([params] * 4))
    drafts = torch.multinomial(p[:3], 1).view(3)
    num_requests = 500
    out, num_accepted = rejection_sample(
        logits.repeat(num_requests, 1), drafts.repeat(num_requests), [3] * num_requests,
        p[:3].repeat(num_requests, 1), meta_for([params] * num_requests),
    )
    assert num_accepted.eq(3).all() and out[:, :3].eq(drafts).all()


def test_draft_outside_target_support_is_never_accepted():
    torch.manual_seed(0)
    logits = peaked_logits([4, 4], vocab_size=10)
    params = SamplingParams(temperature=1.0, top_k=3)  # token 0 has the lowest logit: p(0) = 0
    num_requests = 2000
    out, num_accepted = rejection_sample(
        logits.repeat(num_requests, 1), torch.zeros(num_requests, dtype=torch.int64), [1] * num_requests,
        None, meta_for([params] * num_requests),
    )
    assert num_accepted.eq(0).all() and out[:, 0].ne(0).all()


# ---------------------------------------------------------------- statistical


@dataclass
class Case:
    vocab_size: int
    num_drafts: int
    target: SamplingParams
    draft: SamplingParams | None  # None: n-gram style, fixed drafts with one-hot q
    seed: int


CASES = {
    "V16_K3_draft_topk_zeros": Case(16, 3, SamplingParams(temperature=0.9, top_k=12),
                                    SamplingParams(temperature=1.0, top_k=6, top_p=0.9), seed=1),
    "V37_K2_topp_both": Case(37, 2, SamplingParams(temperature=2.0, top_p=0.8, min_p=0.02),
                             SamplingParams(temperature=1.3, top_k=20, top_p=0.95), seed=2),
    "V64_K2_ngram": Case(64, 2, SamplingParams(temperature=0.7, top_k=40, top_p=0.95), None, seed=3),
}


def chisquare_pvalue(samples: torch.Tensor, probs: torch.Tensor, what: str) -> float:
    """Goodness of fit of integer samples to probs. Cells with zero probability must be empty
    (checked exactly); cells expecting fewer than 5 counts are merged into one."""
    probs = probs.double().numpy()
    counts = np.bincount(samples.numpy(), minlength=len(probs))
    assert counts[len(probs):].sum() == 0 and counts[: len(probs)][probs == 0].sum() == 0, f"{what}: impossible value"
    counts = counts[: len(probs)]
    expected = probs / probs.sum() * len(samples)
    small = (expected < 5) & (probs > 0)
    big = expected >= 5
    observed = np.append(counts[big], counts[small].sum()) if small.any() else counts[big]
    expected_cells = np.append(expected[big], expected[small].sum()) if small.any() else expected[big]
    expected_cells *= observed.sum() / expected_cells.sum()  # chisquare wants equal totals to ~1e-8
    return float(chisquare(observed, expected_cells).pvalue)


def run_case(case: Case):
    """One rejection_sample call over NUM_DRAWS requests sharing the same p_1..p_{K+1} and q_1..q_K."""
    generator = torch.Generator().manual_seed(case.seed)
    torch.manual_seed(case.seed)  # the call itself uses the global RNG (unseeded requests)
    k, vocab_size = case.num_drafts, case.vocab_size
    target_logits = 2.0 * torch.randn(k + 1, vocab_size, generator=generator)
    target_meta = meta_for([case.target])
    p = processed_probs(target_logits, target_meta.expand([k + 1]))  # [K+1, V]
    if case.draft is None:
        q = None
        drafts = p[:k].topk(2, dim=-1).indices[:, 1]  # [K] the second most likely token: a plausible guess
        draft_ids = drafts.repeat(NUM_DRAWS)  # [N*K]: the same fixed proposal for every request
        acceptance = p[torch.arange(k), drafts]  # [K] P(accept x_i) = p_i(x_i)
    else:
        draft_logits = target_logits[:k] + 1.5 * torch.randn(k, vocab_size, generator=generator)
        q = processed_probs(draft_logits, meta_for([case.draft]).expand([k]))  # [K, V]
        drafts = torch.multinomial(q, NUM_DRAWS, replacement=True, generator=generator)  # [K, N]
        draft_ids = drafts.T.reshape(-1)  # requests concatenated
        acceptance = torch.minimum(p[:k], q).sum(dim=-1)  # [K] P(accept x_i) = sum_x min(p_i, q_i)
    out, num_accepted = rejection_sample(
        target_logits.repeat(NUM_DRAWS, 1), draft_ids, [k] * NUM_DRAWS,
        None if q is None else q.repeat(NUM_DRAWS, 1), target_meta.expand([NUM_DRAWS]),
    )
    return p, acceptance.double(), out, num_accepted


def assert_lossless(case: Case):
    p, acceptance, out, num_accepted = run_case(case)
    k = case.num_drafts
    assert chisquare_pvalue(out[:, 0], p[0], "first token") > ALPHA, "first emitted token is not ~ p_1"
    # Targets and drafts here do not depend on the prefix, so given that the first draft was
    # accepted the second emitted token must be ~ p_2 (independent of the first).
    second = out[num_accepted >= 1, 1]
    assert chisquare_pvalue(second, p[1], "second token") > ALPHA, "second emitted token is not ~ p_2"
    # Closed form of the number accepted: P(n) = prod_{i<n} beta_i * (1 - beta_n), P(K) = prod beta_i.
    reach = torch.cat([torch.ones(1, dtype=torch.float64), torch.cumprod(acceptance, 0)])  # [K+1]
    length_probs = reach * torch.cat([1 - acceptance, torch.ones(1, dtype=torch.float64)])
    assert chisquare_pvalue(num_accepted, length_probs, "num accepted") > ALPHA, "acceptance length law"
    emitted = (out != PLACEHOLDER_TOKEN_ID).sum(dim=1)
    assert torch.equal(emitted, num_accepted + 1) and out.shape == (NUM_DRAWS, k + 1)


@pytest.mark.parametrize("name", list(CASES))
def test_output_distribution_is_the_target(name):
    """200,000 requests per case, chi-square tests at significance 1e-3 of: the first emitted
    token against the processed target p_1, the second token (given one accepted) against
    p_2, and the number of accepted drafts against its closed form. Fixed seeds."""
    assert_lossless(CASES[name])


def test_negative_control_resampling_from_p_instead_of_residual_fails(monkeypatch):
    """The same check (200,000 requests, significance 1e-3) must reject a sampler that draws
    the recovered token from p instead of normalize(max(0, p - q))."""
    monkeypatch.setattr(rejection_sampler, "_residual_probs", lambda target_probs, draft_probs: target_probs)
    with pytest.raises(AssertionError, match="first emitted token"):
        assert_lossless(CASES["V16_K3_draft_topk_zeros"])


# ---------------------------------------------------------------- mixed batches


def mixed_requests():
    """(params, seed, num_drafts) per request: greedy, random, K=0 and an unseeded random one."""
    return [
        (SamplingParams(temperature=0.0), 11, 3),
        (SamplingParams(temperature=0.8, top_k=10), 12, 2),
        (SamplingParams(temperature=1.0), 13, 0),
        (SamplingParams(temperature=0.0), None, 0),
        (SamplingParams(temperature=1.1, top_p=0.9, min_p=0.05), 14, 4),
        (SamplingParams(temperature=0.7), None, 3),  # unseeded: consumes the global RNG only
        (SamplingParams(temperature=0.0), None, 2),
    ]


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_mixed_batch_equals_each_request_alone(with_draft_probs):
    vocab_size = 20
    requests = mixed_requests()
    source = torch.Generator().manual_seed(0)
    logits, drafts, draft_probs = [], [], []
    for params, _, k in requests:
        row_logits = 3.0 * torch.randn(k + 1, vocab_size, generator=source)
        q = torch.softmax(row_logits[:k] + torch.randn(k, vocab_size, generator=source), dim=-1)
        row_drafts = torch.multinomial(q, 1, generator=source).view(k) if k else torch.empty(0, dtype=torch.int64)
        if params.is_greedy and k:
            row_drafts[0] = row_logits[0].argmax()  # so the greedy requests accept something
        logits.append(row_logits)
        drafts.append(row_drafts)
        draft_probs.append(q)

    def call(indices):
        gens = [None if requests[i][1] is None else torch.Generator().manual_seed(requests[i][1]) for i in indices]
        return rejection_sample(
            torch.cat([logits[i] for i in indices]), torch.cat([drafts[i] for i in indices]),
            [requests[i][2] for i in indices],
            torch.cat([draft_probs[i] for i in indices]) if with_draft_probs else None,
            meta_for([requests[i][0] for i in indices], gens),
        )

    batch_out, batch_accepted = call(range(len(requests)))
    assert batch_out.shape == (len(requests), 5)
    for i, (params, seed, k) in enumerate(requests):
        if seed is None and not params.is_greedy:
            continue  # unseeded: not reproducible by design
        alone_out, alone_accepted = call([i])
        assert batch_accepted[i] == alone_accepted[0], f"request {i}"
        assert batch_out[i, : k + 1].tolist() == alone_out[0].tolist(), f"request {i}"
        assert batch_out[i, k + 1:].eq(PLACEHOLDER_TOKEN_ID).all()
    assert batch_accepted[0] >= 1 and batch_accepted[6] >= 1  # the greedy drafts matched
