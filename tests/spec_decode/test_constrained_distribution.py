"""Speculative sampling under a grammar reproduces the exact constrained target distribution.

The character-level target and drafts of ``test_spec_distribution`` (30 tokens), constrained
by the regex ``(a[b-f]|b[c-h]|c |[d-j][a-j])[a-m ]+``: the set allowed at the second position
depends on the first token (so each verification row needs the mask after its own drafted
prefix), and after "c" the grammar forces " " (a token appended without a target decision).
The exact joint distribution of the first three tokens is computed by enumeration with the
transformers reference model, masking each position's logits to what the regex allows and
then applying temperature / top-k / top-p (the engine's order).

Statistics: Pearson chi-square, cells with expected count < 5 merged, significance 1e-3,
N = 5000 per case (draft-model chain, draft-model token tree, random EAGLE-3 head chain);
each case has a negative control (the same counts against a 15% hotter target must be
rejected). Deterministic: fixed per-request seeds.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.structured_output import StructuredOutputsParams

from test_spec_distribution import K, PROMPT, char_models, chi_square_p, processed  # noqa: F401

ALPHA = 1e-3
REGEX = r"(a[b-f]|b[c-h]|c |[d-j][a-j])[a-m ]+"


def allowed_sets(tok) -> tuple[set[int], dict[int, set[int]], set[int]]:
    ids = {c: tok.convert_tokens_to_ids(c) for c in "abcdefghijklmnopqrstuvwxyz "}
    span = lambda lo, hi: {ids[chr(c)] for c in range(ord(lo), ord(hi) + 1)}  # noqa: E731
    first = span("a", "j")
    second = {ids["a"]: span("b", "f"), ids["b"]: span("c", "h"), ids["c"]: {ids[" "]}}
    for c in "defghij":
        second[ids[c]] = span("a", "j")
    third = span("a", "m") | {ids[" "]}
    return first, second, third


def exact_constrained_joint(path: str, prompt_ids: list[int], tok, vocab: int, **sampling) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    first, second, third = allowed_sets(tok)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prefix = torch.tensor(prompt_ids)
    grid1 = torch.arange(vocab)[:, None]
    grid2 = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))
    with torch.no_grad():
        l1 = model(prefix[None]).logits[0, -1, :vocab].numpy()
        l2 = model(torch.cat([prefix.expand(vocab, -1), grid1], dim=1)).logits[:, -1, :vocab].numpy()
        l3 = model(torch.cat([prefix.expand(vocab * vocab, -1), grid2], dim=1)).logits[:, -1, :vocab].numpy()

    def masked(logits: np.ndarray, allowed: set[int]) -> np.ndarray:
        out = np.full_like(logits, -np.inf)
        idx = sorted(allowed)
        out[..., idx] = logits[..., idx]
        return out

    p1 = processed(masked(l1, first), **sampling)
    joint = np.zeros((vocab,) * 3)
    l3 = l3.reshape(vocab, vocab, vocab)
    for x1 in first:
        p2 = processed(masked(l2[x1], second[x1]), **sampling)
        p3 = processed(masked(l3[x1], third), **sampling)  # [V(x2), V(x3)]
        joint[x1] = p1[x1] * p2[:, None] * p3
    return joint


@pytest.mark.parametrize("draft, sampling, seed_base, extra", [
    ("noisy", dict(temperature=1.0), 70_000, {}),
    ("noisy", dict(temperature=1.0), 80_000, dict(tree_topk=3, tree_nodes=7)),
    ("eagle3", dict(temperature=0.9, top_k=6), 90_000, {}),
], ids=["draft-chain", "draft-tree", "eagle3-chain-topk"])
def test_constrained_speculative_sampling_is_exact(char_models, draft, sampling, seed_base, extra):
    target, drafts = char_models
    num_samples = 5000
    llm = LLM(model=target, dtype="float32", device="cpu", max_model_len=64, max_num_seqs=1000,
              max_num_batched_tokens=8192,
              speculative_config={"method": "eagle3" if draft == "eagle3" else "draft_model", "model": drafts[draft],
                                  "num_speculative_tokens": K, **extra})
    tok, vocab = llm.tokenizer, llm.engine.vocab_size
    prompt_ids = tok.encode(PROMPT)
    grammar = StructuredOutputsParams(regex=REGEX)
    counts = np.zeros((vocab,) * 3, dtype=np.int64)
    for first in range(0, num_samples, 1000):
        params = [SamplingParams(seed=seed_base + first + i, max_tokens=K + 2, structured_outputs=grammar, **sampling)
                  for i in range(1000)]
        for o in llm.generate([prompt_ids] * 1000, params, use_tqdm=False):
            ids = o.outputs[0].token_ids
            assert len(ids) >= 3
            counts[tuple(ids[:3])] += 1
    m = llm.get_metrics()
    assert m["num_draft_tokens"] > num_samples and 0.02 < m["acceptance_rate"] < 0.95
    if draft == "noisy":  # the " " after "c", when "c" was the target's own (last) token of a step
        assert m["num_forced_tokens"] > 0

    full = dict(temperature=1.0, top_k=0, top_p=1.0) | sampling
    p_value = chi_square_p(counts, exact_constrained_joint(target, prompt_ids, tok, vocab, **full))
    assert p_value > ALPHA, f"constrained speculative samples do not follow the target (p = {p_value:.2e})"
    wrong = full | dict(temperature=full["temperature"] * 1.15)
    control = chi_square_p(counts, exact_constrained_joint(target, prompt_ids, tok, vocab, **wrong))
    assert control < ALPHA, f"negative control was not rejected (p = {control:.2e}): the test has no power"
