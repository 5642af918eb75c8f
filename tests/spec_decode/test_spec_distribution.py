"""End to end: speculative sampling reproduces the target's distribution exactly.

A tiny target and *different* tiny drafts share a 30-token character vocabulary. The
engine (draft model, K = 3) samples 5-token continuations of one prompt many times, each
request with its own seed; the first 3 tokens cover one plainly sampled position (the token
after the prompt) and two speculative ones (accepted drafts, recovered and bonus tokens).
Their joint distribution is computed exactly by enumerating all 30^3 continuations with the
transformers reference model, with the request's temperature / top-k / top-p applied by an
independent numpy implementation of vLLM's rules.

Statistics: Pearson chi-square of the observed 3-token counts against the exact target
probabilities, cells with expected count < 5 merged into one; significance level 1e-3.
Sample sizes: 6000 continuations at temperature 1 with an unrelated draft (mostly
rejected: the residual distribution max(0, p - q) does the work), 6000 with a noisy copy of
the target as draft (about 40% accepted), and 5000 at temperature 0.9 with top_k=6 /
top_p=0.8; then token trees (top-3 children, 7 nodes): 6000 with the noisy draft at
temperature 1 and 5000 with the unrelated draft under top_k / top_p; and a random EAGLE-3 head
(20-token draft vocabulary): 5000 as a chain at temperature 1, 5000 as a tree under top_k / top_p; and
the noisy draft with its LM head cut to 20 tokens (``draft_vocab_size``): 5000 at temperature 1.
Each case has a negative control: the same counts tested against the target at a
15% higher temperature must be rejected at the same level, which shows the test has the
power to see a subtly wrong distribution. Deterministic: fixed per-request seeds.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdec import LLM, SamplingParams

ALPHA = 1e-3
K = 3
PROMPT = "the cat "


@pytest.fixture(scope="module")
def char_models(make_model, make_char_tokenizer, make_perturbed_copy, tmp_path_factory):
    """A target and two drafts: an unrelated model (few guesses accepted: the residual path
    dominates) and the target's weights plus noise (about 40% accepted)."""
    tok = make_char_tokenizer()
    assert len(tok) <= 32
    shape = dict(arch="llama", vocab_size=len(tok), hidden_size=32, num_heads=2, num_kv_heads=1,
                 intermediate_size=64, tokenizer=tok, initializer_range=0.05)
    target = make_model("dist_target", num_layers=2, seed=21, **shape)
    unrelated = make_model("dist_draft", num_layers=1, seed=22, **shape)
    noisy = make_perturbed_copy(target, tmp_path_factory.mktemp("dist_noisy_draft"), scale=0.3, seed=5)
    return target, {"unrelated": unrelated, "noisy": noisy, "eagle3": _eagle3_head(target, tmp_path_factory)}


def _eagle3_head(target: str, tmp_path_factory) -> str:
    """A random EAGLE-3 head over 20 of the 30 tokens (drafts never propose the other 10)."""
    from specdec.models.loader import load_model
    from specdec.models.speculators import save_eagle3
    from specdec.training.train_eagle3 import init_eagle3

    model = load_model(target, torch.float32, torch.device("cpu"))
    head = init_eagle3(model, (0, 1, 1), torch.arange(20), seed=23)
    with torch.no_grad():  # sharper than a fresh head's near-uniform guesses
        head.fc.weight.mul_(20.0)
    out = tmp_path_factory.mktemp("dist_eagle3") / "head"
    save_eagle3(head, out, target, ["LlamaForCausalLM"], K, dtype=torch.float32)
    return str(out)


def processed(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """[..., V] -> probabilities, vLLM's order: temperature, top-k, then top-p over the
    top-k-renormalised probabilities (drop the smallest tokens whose cumulative ascending
    mass stays <= 1 - top_p; the most likely token always stays)."""
    z = logits.astype(np.float64) / temperature
    if top_k:
        kth = np.sort(z, axis=-1)[..., -top_k][..., None]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    if top_p < 1.0:
        order = np.argsort(p, axis=-1)  # ascending
        sorted_p = np.take_along_axis(p, order, axis=-1)
        drop_sorted = np.cumsum(sorted_p, axis=-1) <= 1.0 - top_p
        drop_sorted[..., -1] = False
        drop = np.zeros_like(drop_sorted)
        np.put_along_axis(drop, order, drop_sorted, axis=-1)
        p = np.where(drop, 0.0, p)
        p /= p.sum(axis=-1, keepdims=True)
    return p


def exact_joint(path: str, prompt_ids: list[int], vocab: int, **sampling) -> np.ndarray:
    """[V, V, V]: P(x1, x2, x3 | prompt) of the model at ``path`` under ``sampling``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prefix = torch.tensor(prompt_ids)
    grid1 = torch.arange(vocab)[:, None]  # [V, 1]
    grid2 = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))  # [V*V, 2]
    with torch.no_grad():
        l1 = model(prefix[None]).logits[0, -1]
        l2 = model(torch.cat([prefix.expand(vocab, -1), grid1], dim=1)).logits[:, -1]
        l3 = model(torch.cat([prefix.expand(vocab * vocab, -1), grid2], dim=1)).logits[:, -1]
    p1 = processed(l1[:vocab].numpy(), **sampling)
    p2 = processed(l2[:, :vocab].numpy(), **sampling)
    p3 = processed(l3[:, :vocab].numpy(), **sampling).reshape(vocab, vocab, vocab)
    return p1[:, None, None] * p2[:, :, None] * p3


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square p-value, cells with expected count < 5 merged into one cell."""
    n = counts.sum()
    expected = probs.ravel() * n
    observed = counts.ravel().astype(np.float64)
    big = expected >= 5
    exp_cells = np.append(expected[big], expected[~big].sum())
    obs_cells = np.append(observed[big], observed[~big].sum())
    if exp_cells[-1] < 5:  # the merged tail is itself too small: fold it into the smallest kept cell
        i = int(np.argmin(exp_cells[:-1]))
        exp_cells[i] += exp_cells[-1]
        obs_cells[i] += obs_cells[-1]
        exp_cells, obs_cells = exp_cells[:-1], obs_cells[:-1]
    assert len(exp_cells) >= 10, "too few cells for a meaningful test"
    exp_cells *= obs_cells.sum() / exp_cells.sum()  # float rounding only
    return float(chisquare(obs_cells, exp_cells).pvalue)


def sample_continuations(llm: LLM, prompt_ids: list[int], num_samples: int, seed_base: int, sampling: dict,
                         wave: int = 1000) -> list[list[int]]:
    """num_samples continuations, each request with its own seed. Submitted in waves of
    ``wave`` identical requests so that most steps have one query length for every request."""
    out = []
    for first in range(0, num_samples, wave):
        n = min(wave, num_samples - first)
        params = [SamplingParams(seed=seed_base + first + i, max_tokens=K + 2, ignore_eos=True, **sampling)
                  for i in range(n)]
        out += [o.outputs[0].token_ids for o in llm.generate([prompt_ids] * n, params, use_tqdm=False)]
    return out


def check_speculative_samples_follow(llm: LLM, target: str, num_samples: int, what: str) -> None:
    """Sample ``num_samples`` first-three-token continuations of PROMPT at temperature 1 from a
    speculating ``llm`` and check them against ``target``'s exact joint (p > ALPHA), with drafts
    really tried and sometimes rejected, and the negative control (the target at temperature 1.15)
    rejected (p < ALPHA)."""
    vocab = llm.engine.vocab_size
    prompt_ids = llm.tokenizer.encode(PROMPT)
    counts = np.zeros((vocab,) * 3, dtype=np.int64)
    for token_ids in sample_continuations(llm, prompt_ids, num_samples, 80_000, dict(temperature=1.0)):
        counts[tuple(token_ids[:3])] += 1
    m = llm.get_metrics()
    assert m["num_draft_tokens"] > num_samples and 0.02 < m["acceptance_rate"] < 0.9
    full = dict(temperature=1.0, top_k=0, top_p=1.0)
    p_value = chi_square_p(counts, exact_joint(target, prompt_ids, vocab, **full))
    assert p_value > ALPHA, f"speculative samples do not follow the {what} (p = {p_value:.2e})"
    control = chi_square_p(counts, exact_joint(target, prompt_ids, vocab, **(full | dict(temperature=1.15))))
    assert control < ALPHA, f"negative control was not rejected (p = {control:.2e}): the test has no power"


TREE = dict(tree_topk=3, tree_nodes=7)  # token trees: children tried in turn against the residual
DRAFT_VOCAB = dict(draft_vocab_size=20)  # the draft's LM head cut to 20 of the 30 tokens (q = 0 elsewhere)
CONFIDENCE = dict(draft_confidence_threshold=0.3)  # chains cut where the draft's top-1 probability < 0.3


@pytest.mark.parametrize("draft, num_samples, sampling, seed_base, tree", [
    ("unrelated", 6000, dict(temperature=1.0), 0, {}),
    ("noisy", 6000, dict(temperature=1.0), 10_000, {}),
    ("noisy", 5000, dict(temperature=0.9, top_k=6, top_p=0.8), 20_000, {}),
    ("noisy", 6000, dict(temperature=1.0), 30_000, TREE),
    ("unrelated", 5000, dict(temperature=0.9, top_k=6, top_p=0.8), 40_000, TREE),
    ("eagle3", 5000, dict(temperature=1.0), 50_000, {}),
    ("eagle3", 5000, dict(temperature=0.9, top_k=6, top_p=0.8), 60_000, TREE),
    ("noisy", 5000, dict(temperature=1.0), 70_000, DRAFT_VOCAB),
    ("noisy", 5000, dict(temperature=1.0), 80_000, CONFIDENCE),
], ids=["unrelated-draft", "noisy-draft", "noisy-draft-topk-topp", "noisy-tree", "unrelated-tree-topk-topp",
        "eagle3-head", "eagle3-tree-topk-topp", "noisy-draft-20-token-vocab",
        "noisy-draft-confidence-stop"])
def test_speculative_sampling_matches_the_exact_target_distribution(char_models, draft, num_samples, sampling,
                                                                    seed_base, tree, tmp_path):
    target, drafts = char_models
    if "draft_vocab_size" in tree:  # tokens 10..29 kept: the drafts never propose 0..9
        (tmp_path / "vocab.json").write_text(str(list(range(10, 30))))
        tree = dict(tree, draft_vocab=str(tmp_path / "vocab.json"))
    llm = LLM(model=target, dtype="float32", device="cpu", max_model_len=64, max_num_seqs=1000,
              max_num_batched_tokens=8192,
              speculative_config={"method": "eagle3" if draft == "eagle3" else "draft_model", "model": drafts[draft],
                                  "num_speculative_tokens": K,
                                  **tree})
    vocab = llm.engine.vocab_size
    prompt_ids = llm.tokenizer.encode(PROMPT)
    counts = np.zeros((vocab,) * 3, dtype=np.int64)
    for token_ids in sample_continuations(llm, prompt_ids, num_samples, seed_base, sampling):
        assert len(token_ids) == K + 2
        counts[tuple(token_ids[:3])] += 1

    m = llm.get_metrics()
    assert m["num_draft_tokens"] > num_samples  # speculation really ran ...
    assert 0.02 < m["acceptance_rate"] < 0.9  # ... with both accepted and rejected drafts
    if "draft_confidence_threshold" in tree:  # ... and chains cut short on some steps, not all
        assert m["num_drafts"] < m["num_draft_tokens"] < K * m["num_drafts"]

    full = dict(temperature=1.0, top_k=0, top_p=1.0) | sampling
    p_value = chi_square_p(counts, exact_joint(target, prompt_ids, vocab, **full))
    assert p_value > ALPHA, f"speculative samples do not follow the target (p = {p_value:.2e})"
    # negative control: a 15% temperature error must be visible at this sample size
    wrong = full | dict(temperature=full["temperature"] * 1.15)
    control = chi_square_p(counts, exact_joint(target, prompt_ids, vocab, **wrong))
    assert control < ALPHA, f"negative control was not rejected (p = {control:.2e}): the test has no power"
