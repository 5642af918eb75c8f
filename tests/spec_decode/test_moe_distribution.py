"""Speculative sampling on a mixture-of-experts target reproduces its distribution exactly.

The pattern of ``test_spec_distribution.py`` with a tiny Qwen3-MoE target (top-2 of 8 experts,
router weights scaled so that routing differs between rows) over a 30-token character vocabulary
and a noisy copy of it as the draft (K = 3). The joint distribution of the first 3 sampled tokens
is computed exactly by enumerating all 30^3 continuations with transformers' model.

Statistics: Pearson chi-square, cells with expected count < 5 merged; N = 6000 continuations at
temperature 1, significance level 1e-3. Negative control: the same counts against the target at a
15% higher temperature must be rejected at the same level.
"""
from __future__ import annotations

from test_spec_distribution import K, check_speculative_samples_follow

from specdec import LLM

NUM_SAMPLES = 6000


def test_speculative_sampling_on_a_moe_target(make_model, make_char_tokenizer, make_perturbed_copy, tmp_path_factory):
    tok = make_char_tokenizer()
    shape = dict(arch="qwen3_moe", vocab_size=len(tok), hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16,
                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                 tokenizer=tok, initializer_range=0.05)
    target = make_model("moe_dist_target", num_layers=2, seed=31, router_scale=20.0, **shape)
    draft = make_perturbed_copy(target, tmp_path_factory.mktemp("moe_dist_draft"), scale=0.3, seed=5)
    llm = LLM(model=target, dtype="float32", device="cpu", max_model_len=64, max_num_seqs=1000,
              max_num_batched_tokens=8192,
              speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": K})
    check_speculative_samples_follow(llm, target, NUM_SAMPLES, "MoE target")
