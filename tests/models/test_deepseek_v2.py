"""DeepSeek-V2 token-identical to transformers in float32: V3's MLA (always-interleaved rotary
pairs) with V2's softmax router, group-limited (4 groups, the 2 of highest maximum score) and
greedy, scaled, routers scaled up so rows route to different experts; logits, plain / chunked /
prefix-cached and n-gram speculative runs."""
from __future__ import annotations

import pytest
from family_parity import HFGreedy, check_plain_chunked_and_prefix_cached, check_speculative
from test_deepseek_v3 import DS, MAX_MODEL_LEN, _logits_match, _route_widely

V2 = {k: v for k, v in DS.items() if k not in ("arch", "n_group", "topk_group", "routed_scaling_factor")}


@pytest.fixture(scope="module", params=["group_limited_greedy", "greedy"])
def target(request, make_model):
    groups = dict(n_group=4, topk_group=2) if request.param == "group_limited_greedy" else {}
    path = make_model(f"deepseek_v2_{request.param}", arch="deepseek_v2", topk_method=request.param,
                      routed_scaling_factor=1.5, **groups, **V2)
    return _route_widely(path, seed=4)


@pytest.fixture(scope="module")
def batch(tiny_tokenizer, prompts):
    return [tiny_tokenizer.encode(s) for s in prompts[:5]] + [tiny_tokenizer.encode(prompts[10])]


def test_logits_match_transformers(target, batch):
    _logits_match(target, batch)


def test_greedy_plain_prefix_cached_and_ngram(target, batch):
    reference = HFGreedy(target, 12)
    shared = [list(range(40, 57)) + [60 + i] * (i + 1) for i in range(3)]
    check_plain_chunked_and_prefix_cached(target, batch, shared, reference, MAX_MODEL_LEN, chunk_budget=8)
    check_speculative(target, batch, reference, MAX_MODEL_LEN, {"method": "ngram", "prompt_lookup_min": 1,
                                                                 "prompt_lookup_max": 3, "num_speculative_tokens": 3})
