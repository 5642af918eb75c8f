"""The Triton rejection sampler equals the torch reference exactly given the same random
draws (same generators / global seed), on ragged greedy, random and mixed batches; and the
kernel core, fed its own uniforms and exponentials, samples the target distribution.

On CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before Triton is
imported); scripts/gpu_check.sh runs this file compiled with SPECDEC_KERNEL_DEVICE=cuda."""
import os

DEVICE = os.environ.get("SPECDEC_KERNEL_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton; it is in the 'test' extra)")

import torch
from scipy.stats import chisquare

from specdec.kernels.triton import load
from specdec.layers.sampler import SamplingMetadata
from specdec.sampling_params import SamplingParams
from specdec.spec_decode.rejection_sampler import rejection_sample

kernels = load("rejection_sampler")
from specdec.spec_decode.rejection_sampler_triton import rejection_sample_triton  # noqa: E402 (after the mode is checked)

ALPHA = 1e-3  # significance level of the statistical assertion below


def draft_batch(num_draft_tokens, vocab_size, seed, *, peaked=True):
    """Target logits, and drafts sampled from a perturbed target so that runs of acceptances
    and rejections both happen."""
    gen = torch.Generator().manual_seed(seed)
    num_rows = sum(num_draft_tokens) + len(num_draft_tokens)
    target_logits = torch.randn(num_rows, vocab_size, generator=gen) * (3.0 if peaked else 1.0)
    draft_rows = torch.cat([torch.arange(s, s + k) for s, k in zip(_row_starts(num_draft_tokens), num_draft_tokens)])
    draft_logits = target_logits[draft_rows] + 0.7 * torch.randn(len(draft_rows), vocab_size, generator=gen)
    draft_probs = draft_logits.softmax(-1)
    draft_token_ids = torch.multinomial(draft_probs, 1, generator=gen).squeeze(1) if len(draft_rows) else \
        torch.empty(0, dtype=torch.int64)
    return target_logits, draft_token_ids, draft_probs


def _row_starts(num_draft_tokens):
    starts, s = [], 0
    for k in num_draft_tokens:
        starts.append(s)
        s += k + 1
    return starts


def run_both(params, num_draft_tokens, target_logits, draft_token_ids, draft_probs, seeds, global_seed):
    """Call reference and kernel with identical generator states (both on DEVICE, since CPU
    and CUDA generators give different streams); return both results."""
    results = []
    for fn, device in ((rejection_sample, DEVICE), (rejection_sample_triton, DEVICE)):
        generators = [None if s is None else torch.Generator(device=device).manual_seed(s) for s in seeds]
        meta = SamplingMetadata.from_params(params, generators, device)
        torch.manual_seed(global_seed)
        if device != "cpu":
            torch.cuda.manual_seed(global_seed)
        out, num_accepted = fn(target_logits.to(device), draft_token_ids.to(device), num_draft_tokens,
                               None if draft_probs is None else draft_probs.to(device), meta)
        results.append((out.cpu(), num_accepted.cpu()))
    return results


GREEDY = SamplingParams(temperature=0.0)
RANDOM = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9),
          SamplingParams(temperature=1.2, top_k=20), SamplingParams(temperature=0.9, min_p=0.05)]


@pytest.mark.parametrize("kind", ["greedy", "random", "mixed"])
@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_equals_reference_exactly(kind, with_draft_probs):
    num_draft_tokens = [3, 0, 8, 1, 5, 2, 7]
    vocab_size = 257
    if kind == "greedy":
        params = [GREEDY] * len(num_draft_tokens)
    elif kind == "random":
        params = [RANDOM[i % len(RANDOM)] for i in range(len(num_draft_tokens))]
    else:
        params = [GREEDY if i % 3 == 0 else RANDOM[i % len(RANDOM)] for i in range(len(num_draft_tokens))]
    seeds = [None if i % 2 else 1000 + i for i in range(len(num_draft_tokens))]  # seeded and global-RNG rows
    for trial in range(3):
        target_logits, draft_token_ids, draft_probs = draft_batch(num_draft_tokens, vocab_size, seed=trial)
        if kind == "greedy":  # make greedy acceptance runs likely: drafts = target argmax, a few flipped
            draft_token_ids = _greedy_drafts(target_logits, num_draft_tokens, flip_every=3 + trial)
        (ref_out, ref_acc), (out, acc) = run_both(params, num_draft_tokens, target_logits, draft_token_ids,
                                                   draft_probs if with_draft_probs else None, seeds, trial)
        assert torch.equal(out, ref_out), (trial, out, ref_out)
        assert torch.equal(acc, ref_acc)
    # the cases exercised include accepted runs, rejections and bonus tokens
    assert ref_acc.max() > 0 or kind != "greedy"


def _greedy_drafts(target_logits, num_draft_tokens, flip_every):
    argmax = target_logits.argmax(-1)
    drafts = []
    for start, k in zip(_row_starts(num_draft_tokens), num_draft_tokens):
        drafts.append(argmax[start:start + k])
    drafts = torch.cat(drafts).clone()
    drafts[::flip_every] = (drafts[::flip_every] + 1) % target_logits.shape[1]
    return drafts


def test_all_requests_without_drafts():
    params = [RANDOM[0], GREEDY, RANDOM[1]]
    target_logits, draft_token_ids, _ = draft_batch([0, 0, 0], 50, seed=4)
    (ref_out, ref_acc), (out, acc) = run_both(params, [0, 0, 0], target_logits, draft_token_ids, None,
                                               [7, None, None], 4)
    assert out.shape == (3, 1) and torch.equal(out, ref_out) and torch.equal(acc, ref_acc)


def _oracle(target_probs, draft_token_ids, num_draft_tokens, draft_probs, uniforms, noise):
    """The random path in plain Python over the same uniforms and exponentials."""
    out = torch.full((len(num_draft_tokens), max(num_draft_tokens) + 1), -1)
    num_accepted = torch.zeros(len(num_draft_tokens), dtype=torch.int64)
    d = 0
    for r, k in enumerate(num_draft_tokens):
        row = sum(num_draft_tokens[:r]) + r
        i = 0
        while i < k and uniforms[r, i] * draft_probs[d + i, draft_token_ids[d + i]] < target_probs[row + i, draft_token_ids[d + i]]:
            out[r, i] = draft_token_ids[d + i]
            i += 1
        p = target_probs[row + i]
        weights = (p - draft_probs[d + i]).clamp_min(0) if i < k else p
        if weights.sum() == 0:
            weights = p
        out[r, i] = (weights / noise[r]).argmax()
        num_accepted[r] = i
        d += k
    return out, num_accepted


def test_core_entry_equals_python_oracle_on_given_noise():
    gen = torch.Generator().manual_seed(21)
    num_draft_tokens, vocab_size = [4, 1, 6, 2], 97
    target_logits = torch.randn(sum(num_draft_tokens) + 4, vocab_size, generator=gen).mul(2)
    target_probs = target_logits.softmax(-1)
    draft_rows = torch.cat([torch.arange(s, s + k) for s, k in zip(_row_starts(num_draft_tokens), num_draft_tokens)])
    draft_probs = (target_logits[draft_rows] + torch.randn(len(draft_rows), vocab_size, generator=gen)).softmax(-1)
    draft_token_ids = torch.multinomial(draft_probs, 1, generator=gen).squeeze(1)
    uniforms = torch.rand(4, 6, generator=gen) * 0.5  # low uniforms: long accepted runs and bonus tokens
    noise = torch.empty(4, vocab_size).exponential_(generator=gen)
    cu = torch.tensor([0, 4, 5, 11, 13])
    out, acc = kernels.rejection_sample_core_triton(
        draft_token_ids.to(DEVICE), cu.to(DEVICE), 6, target_probs=target_probs.to(DEVICE),
        draft_probs=draft_probs.to(DEVICE), uniforms=uniforms.to(DEVICE), exponential_noise=noise.to(DEVICE))
    expected_out, expected_acc = _oracle(target_probs, draft_token_ids, num_draft_tokens, draft_probs, uniforms, noise)
    assert torch.equal(out.cpu(), expected_out) and torch.equal(acc.cpu(), expected_acc)
    assert (expected_acc == torch.tensor(num_draft_tokens)).any() and (expected_acc < torch.tensor(num_draft_tokens)).any()


# The interpreter runs one program at a time (~20 ms each here), so the CPU run is small;
# exact equality with the reference above carries the reference's own statistical tests over.
NUM_REQUESTS = 400 if DEVICE == "cpu" else 50_000


def test_core_samples_the_target_distribution():
    """K=2 drafts from q, NUM_REQUESTS identical requests in one launch: the first emitted token
    must follow p_1 (chi-square at ALPHA over 6 tokens); the drafts themselves (distributed as
    q) fail the same test, so it has power at this sample size (negative control)."""
    gen = torch.Generator().manual_seed(5)
    num_requests, vocab_size, k = NUM_REQUESTS, 6, 2
    p = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.07, 0.03])
    q = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.25, 0.25])
    target_probs = p.repeat(num_requests * (k + 1), 1)
    draft_probs = q.repeat(num_requests * k, 1)
    draft_token_ids = torch.multinomial(draft_probs, 1, generator=gen).squeeze(1)
    uniforms = torch.rand(num_requests, k, generator=gen)
    noise = torch.empty(num_requests, vocab_size).exponential_(generator=gen)
    cu = torch.arange(0, num_requests * k + 1, k)
    out, _ = kernels.rejection_sample_core_triton(
        draft_token_ids.to(DEVICE), cu.to(DEVICE), k, target_probs=target_probs.to(DEVICE),
        draft_probs=draft_probs.to(DEVICE), uniforms=uniforms.to(DEVICE), exponential_noise=noise.to(DEVICE))
    expected = (p.double() / p.double().sum() * num_requests).numpy()
    counts = torch.bincount(out[:, 0].cpu(), minlength=vocab_size).double().numpy()
    assert chisquare(counts, expected).pvalue > ALPHA
    draft_counts = torch.bincount(draft_token_ids.view(num_requests, k)[:, 0], minlength=vocab_size).double().numpy()
    assert chisquare(draft_counts, expected).pvalue < ALPHA


def test_core_requires_noise_for_random_rows():
    with pytest.raises(ValueError, match="uniforms and exponential_noise"):
        kernels.rejection_sample_core_triton(torch.zeros(1, dtype=torch.int64), torch.tensor([0, 1]), 1,
                                             target_probs=torch.ones(2, 4) / 4)
