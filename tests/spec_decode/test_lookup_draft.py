"""Method "draft_model_lookup": prompt lookup where the context repeats itself, the draft model
for the other requests of the step. Greedy output is the target's (fixed K, "auto" K and the
draft's confidence threshold), both proposers really fill drafts in one run, and sampled output
follows the target's exact distribution (chi-square, the pattern and helpers of
test_spec_distribution.py: N = 5000 continuations at temperature 1, alpha = 1e-3, fixed seeds,
with a negative control at temperature 1.15)."""
from __future__ import annotations

import numpy as np
import pytest

from specdec import LLM, SamplingParams
from specdec.config import SpeculativeConfig
from specdec.spec_decode.lookup_draft import LookupDraftProposer
from tests.spec_decode.test_spec_distribution import ALPHA, chi_square_p, exact_joint, sample_continuations

# repeated lines and names, so the lookup finds matches; ragged lengths
REPETITIVE = [
    "for i in range(10):\n    x = x + 1\nfor i in range(10):\n    x = x + 1\nfor i in range(",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
    "import json\nimport json\nimport",
    "lines = text.splitlines()\nlines = text.",
]


@pytest.fixture
def lookup_counts(monkeypatch):
    """Per step of every engine built in the test: (requests the lookup filled, requests drafted)."""
    counts = []
    merge = LookupDraftProposer._merge

    def spy(self, proposal, lookups):
        counts.append((sum(1 for lk in lookups if lk), sum(1 for lk, d in zip(lookups, proposal.draft_token_ids)
                                                          if d and not lk)))
        return merge(self, proposal, lookups)

    monkeypatch.setattr(LookupDraftProposer, "_merge", spy)
    return counts


def _generate(path: str, prompts: list[str], spec: dict | None, max_tokens: int = 24):
    llm = LLM(model=path, dtype="float32", device="cpu", max_model_len=256, speculative_config=spec)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.get_metrics()


@pytest.mark.parametrize("extra", [
    {"num_speculative_tokens": 4},
    {"num_speculative_tokens": 4, "prompt_lookup": {"source": "ngram", "min_match": 2, "min_tokens": 1}},
    {"num_speculative_tokens": 4, "prompt_lookup": {"source": "ngram", "min_match": 3, "min_tokens": 2}},
    {"num_speculative_tokens": "auto", "max_num_speculative_tokens": 5},
    {"num_speculative_tokens": 4, "draft_confidence_threshold": 0.3},
], ids=["suffix", "ngram-short-matches", "ngram", "auto-k", "confidence"])
def test_greedy_output_is_the_targets(llama_path, noisy_draft_path, lookup_counts, extra):
    expected, _ = _generate(llama_path, REPETITIVE, None)
    got, m = _generate(llama_path, REPETITIVE, {"method": "draft_model_lookup", "model": noisy_draft_path, **extra})
    assert got == expected
    if extra["num_speculative_tokens"] == 4:  # "auto" may plan few drafts on a tiny model
        assert sum(n for n, _ in lookup_counts) > 0, "the lookup never filled a request's drafts"
        assert m["num_drafts"] > sum(n for n, _ in lookup_counts), "the draft model never drafted"


def test_lookup_and_model_share_a_step(llama_path, noisy_draft_path, lookup_counts):
    """A batch whose requests choose differently: the model drafts only for the rows the lookup left."""
    prompts = REPETITIVE + ["Hello", "z", "The quick brown fox"]
    expected, _ = _generate(llama_path, prompts, None, max_tokens=12)
    got, _ = _generate(llama_path, prompts, {"method": "draft_model_lookup", "model": noisy_draft_path,
                                             "num_speculative_tokens": 3,
                                             "prompt_lookup": {"source": "ngram", "min_match": 2}}, max_tokens=12)
    assert got == expected
    assert any(looked and drafted for looked, drafted in lookup_counts)


@pytest.mark.parametrize("spec, match", [
    ({"method": "draft_model", "model": "m", "prompt_lookup": {}}, "prompt_lookup applies to method"),
    ({"method": "draft_model_lookup", "model": "m", "prompt_lookup": {"source": "tree"}}, "prompt_lookup.source"),
    ({"method": "draft_model_lookup", "model": "m", "prompt_lookup": {"min_match": 0}}, "prompt_lookup.min_match"),
    ({"method": "draft_model_lookup", "model": "m", "prompt_lookup": {"min_match": 4, "max_match": 3}},
     "prompt_lookup.max_match"),
    ({"method": "draft_model_lookup", "model": "m", "prompt_lookup": {"min_tokens": 2.5}}, "prompt_lookup.min_tokens"),
    ({"method": "draft_model_lookup", "model": "m", "prompt_lookup": {"min_len": 2}}, "unknown field"),
    ({"method": "draft_model_lookup", "model": "m", "prompt_lookup": 3}, "must be a dict"),
    ({"method": "draft_model_lookup", "model": "m", "tree_topk": 2}, "tree_topk"),
    ({"method": "draft_model_lookup"}, "speculative_config.model"),
])
def test_bad_configs_name_the_field(spec, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig(**spec)


def test_defaults_are_accepted():
    spec = SpeculativeConfig(method="draft_model_lookup", model="m", draft_vocab_size=100,
                             prompt_lookup={"source": "suffix", "min_tokens": 3})
    assert spec.prompt_lookup == {"source": "suffix", "min_tokens": 3}


# ---- sampling: the exact distribution ----
PROMPT = "the quick brown fox jumps "  # most characters recur: after one sampled token the lookup often matches
K = 3


@pytest.fixture(scope="module")
def char_pair(make_model, make_char_tokenizer, make_perturbed_copy, tmp_path_factory):
    """The char-level target of test_spec_distribution.py and its noisy copy as the draft."""
    tok = make_char_tokenizer()
    shape = dict(arch="llama", vocab_size=len(tok), hidden_size=32, num_heads=2, num_kv_heads=1,
                 intermediate_size=64, tokenizer=tok, initializer_range=0.05)
    target = make_model("dist_target", num_layers=2, seed=21, **shape)
    return target, make_perturbed_copy(target, tmp_path_factory.mktemp("lookup_noisy_draft"), scale=0.3, seed=5)


def test_sampling_matches_the_exact_target_distribution(char_pair, lookup_counts):
    target, draft = char_pair
    llm = LLM(model=target, dtype="float32", device="cpu", max_model_len=64, max_num_seqs=1000,
              max_num_batched_tokens=8192,
              speculative_config={"method": "draft_model_lookup", "model": draft, "num_speculative_tokens": K,
                                  "prompt_lookup": {"source": "ngram", "min_match": 1, "min_tokens": 1}})
    vocab = llm.engine.vocab_size
    prompt_ids = llm.tokenizer.encode(PROMPT)
    counts = np.zeros((vocab,) * 3, dtype=np.int64)
    num_samples = 5000
    for token_ids in sample_continuations(llm, prompt_ids, num_samples, 90_000, dict(temperature=1.0), wave=1000):
        counts[tuple(token_ids[:3])] += 1
    m = llm.get_metrics()
    assert m["num_draft_tokens"] > num_samples and 0.02 < m["acceptance_rate"] < 0.9
    # both proposers filled rows of the same steps (the q rows mix one-hot and sampled)
    assert sum(1 for looked, drafted in lookup_counts if looked and drafted) > 0
    full = dict(temperature=1.0, top_k=0, top_p=1.0)
    p_value = chi_square_p(counts, exact_joint(target, prompt_ids, vocab, **full))
    assert p_value > ALPHA, f"samples do not follow the target (p = {p_value:.2e})"
    control = chi_square_p(counts, exact_joint(target, prompt_ids, vocab, **(full | dict(temperature=1.15))))
    assert control < ALPHA, f"negative control was not rejected (p = {control:.2e}): the test has no power"
