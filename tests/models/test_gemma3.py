"""Gemma 3 (text) token-identical to transformers in float32: two sliding-window layers (window 8,
so every sequence here outgrows it) around a global one, each kind with its own rotary base,
linear rope scaling on the global layers, final logit soft-capping, randomised (1 + w) norms.
Plain, chunked, prefix-cached, preempted and speculative (a small Gemma 3 draft, a noisy copy of
the target with chains and trees, n-gram) runs of one ragged batch."""
from __future__ import annotations

import pytest
import torch
from family_parity import (
    HFGreedy, check_plain_chunked_and_prefix_cached, check_preemption, check_speculative, check_tensor_parallel,
)

NUM_NEW = 24
MAX_MODEL_LEN = 96
WINDOW = 8
GEMMA3 = dict(arch="gemma3", num_layers=3, head_dim=16, sliding_window=WINDOW, sliding_window_pattern=3,
              query_pre_attn_scalar=24, final_logit_softcapping=30.0,
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                               "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0}})


@pytest.fixture(scope="module")
def target(make_model):
    return make_model("gemma3_target", initializer_range=0.05, random_norms_and_biases=True, **GEMMA3)


@pytest.fixture(scope="module")
def small_draft(make_model):
    return make_model("gemma3_draft", **{**GEMMA3, "num_layers": 1, "hidden_size": 32, "num_heads": 2,
                                         "num_kv_heads": 1, "intermediate_size": 64, "seed": 7})


@pytest.fixture(scope="module")
def noisy_draft(target, make_perturbed_copy, tmp_path_factory):
    return make_perturbed_copy(target, tmp_path_factory.mktemp("gemma3_noisy"), scale=0.1, seed=3)


@pytest.fixture(scope="module")
def reference(target):
    return HFGreedy(target, NUM_NEW)


@pytest.fixture(scope="module")
def batch(tiny_tokenizer, prompts):
    encoded = [tiny_tokenizer.encode(p) for p in prompts[:8]]
    prefix = tiny_tokenizer.encode(prompts[10])  # 20+ tokens shared by the second group
    shared = [prefix + tiny_tokenizer.encode(t) for t in ("    margin = None", "    return", "x")]
    assert len({len(p) for p in encoded}) > 4 and len(prefix) > 2 * WINDOW
    return encoded, shared


def test_layers_follow_the_config(target):
    from specdec.models.loader import load_model

    model = load_model(target, torch.float32, torch.device("cpu"))
    assert [layer.self_attn.sliding_window for layer in model.layers] == [WINDOW, WINDOW, None]
    assert [layer.is_sliding for layer in model.layers] == [True, True, False]
    assert model.rotary_local.theta == 10_000.0 and model.rotary.theta == 1_000_000.0


@pytest.mark.parametrize("backend", ["auto", "torch"])  # auto: the C++ rows kernel where it builds
def test_plain_chunked_and_prefix_cached(backend, target, reference, batch):
    check_plain_chunked_and_prefix_cached(target, batch[0], batch[1], reference, MAX_MODEL_LEN,
                                          attention_backend=backend)


def test_the_window_changes_the_output(target, reference, batch):
    """Negative control: without the window (every layer global) transformers itself decodes the
    long prompts differently, so the tests above depend on the window being applied."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(target)
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    unwindowed = AutoModelForCausalLM.from_pretrained(target, config=config, dtype=torch.float32).eval()
    ids = batch[1][0]
    with torch.no_grad():
        out = unwindowed.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  do_sample=False, max_new_tokens=NUM_NEW, eos_token_id=None, pad_token_id=0)
    assert out[0, len(ids):].tolist() != reference(ids)


def test_preemption_with_a_draft(target, small_draft, reference, batch):
    check_preemption(target, batch[0][:6], reference, MAX_MODEL_LEN, draft=small_draft)


@pytest.mark.parametrize("method", ["small_draft", "noisy_chain", "noisy_tree", "ngram"])
def test_speculation_is_greedy_identical(method, target, small_draft, noisy_draft, reference, batch):
    spec = {
        "small_draft": {"method": "draft_model", "model": small_draft, "num_speculative_tokens": 3},
        "noisy_chain": {"method": "draft_model", "model": noisy_draft, "num_speculative_tokens": 4},
        "noisy_tree": {"method": "draft_model", "model": noisy_draft, "num_speculative_tokens": 3,
                       "tree_topk": 2, "tree_nodes": 6},
        "ngram": {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3, "num_speculative_tokens": 3},
    }[method]
    check_speculative(target, batch[0] + batch[1], reference, MAX_MODEL_LEN, spec,
                      expect_accepted=method != "small_draft")


def test_two_tensor_parallel_ranks(target, reference, batch):
    check_tensor_parallel(target, batch[0][:4], reference, MAX_MODEL_LEN)


def test_a_tree_deeper_than_the_window_is_refused_at_start(target, noisy_draft):
    from specdec import LLM

    with pytest.raises(ValueError, match="num_speculative_tokens 9 .* sliding window of 8"):
        LLM(model=target, dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN,
            speculative_config={"method": "draft_model", "model": noisy_draft, "num_speculative_tokens": 9,
                                "tree_topk": 2, "tree_nodes": 12})
