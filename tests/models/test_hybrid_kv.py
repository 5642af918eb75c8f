"""Hybrid models (sliding-window layers beside full-attention ones: Gemma 3, gpt-oss) keep one KV
block table per group of layers: the sliding group gives back its blocks behind the window while
the full-attention group grows with the sequence. Token-identical to transformers (float32) with
prefill in small chunks, preemption, prefix caching, and speculation (draft model, n-gram)."""
from __future__ import annotations

import pytest
import torch
from family_parity import HFGreedy, greedy_params

from specdec import LLM, SamplingParams
from specdec.worker.kv_budget import blocks_per_sequence
from specdec.worker.model_runner import ModelRunner

ENGINE = dict(dtype="float32", device="cpu")
WINDOW = 8
BS = 4  # block size
CHUNK = 16  # max_num_batched_tokens: prefill chunks, so a sliding group's need is window-limited
MAX_MODEL_LEN = 128
NUM_NEW = 48
FAMILIES = {
    # two sliding layers around a global one
    "gemma3": dict(arch="gemma3", num_layers=3, head_dim=16, sliding_window=WINDOW, sliding_window_pattern=3,
                   query_pre_attn_scalar=24, initializer_range=0.05, random_norms_and_biases=True),
    # sliding and full layers alternate; sinks, MoE
    "gpt_oss": dict(arch="gpt_oss", num_layers=2, head_dim=16, intermediate_size=64, num_local_experts=8,
                    num_experts_per_tok=2, sliding_window=WINDOW, initializer_range=0.05, router_scale=20.0,
                    random_norms_and_biases=True),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, make_model, make_perturbed_copy, tmp_path_factory):
    name = request.param
    target = make_model(f"hybrid_{name}", **FAMILIES[name])
    draft = make_perturbed_copy(target, tmp_path_factory.mktemp(f"hybrid_{name}_noisy"), scale=0.1, seed=3)
    return name, target, draft, HFGreedy(target, NUM_NEW)


@pytest.fixture(scope="module")
def batch(tiny_tokenizer, prompts):
    encoded = [tiny_tokenizer.encode(p) for p in prompts[:6]]
    prefix = tiny_tokenizer.encode(prompts[10])
    shared = [prefix + tiny_tokenizer.encode(t) for t in ("    margin = None", "    return", "x")]
    assert len(prefix) > 2 * WINDOW
    return encoded, shared


def engine_args(**kw) -> dict:
    return dict(**ENGINE, max_model_len=MAX_MODEL_LEN, block_size=BS, max_num_batched_tokens=CHUNK, **kw)


def assert_matches(llm: LLM, prompts, reference: HFGreedy, params=None) -> None:
    outs = llm.generate([list(p) for p in prompts], params or greedy_params(NUM_NEW), use_tqdm=False)
    for out, ids in zip(outs, prompts):
        assert out.outputs[0].token_ids == reference(ids), f"prompt {ids[:8]}... diverged from transformers"


def assert_no_leaks(llm: LLM) -> None:
    for group in llm.engine.kv.groups:
        assert group.pool.num_free_blocks == group.pool.num_blocks and all(b.ref_cnt == 0 for b in group.pool.blocks)


def live(blocks) -> int:
    return sum(b is not None for b in blocks)


def test_layers_are_grouped_by_window_and_the_budget_counts_each_group(family):
    name, target, _, _ = family
    llm = LLM(model=target, **engine_args(max_num_seqs=4))
    layout = llm.engine.runtime_plan.kv_layout
    sliding_layers = {"gemma3": (0, 1), "gpt_oss": (0,)}[name]
    full_layers = {"gemma3": (2,), "gpt_oss": (1,)}[name]
    assert [(g.window, g.layers) for g in layout.groups] == [(None, full_layers), (WINDOW, sliding_layers)]
    cfg = llm.engine.config
    per_seq_full = blocks_per_sequence(cfg, MAX_MODEL_LEN, 0)
    per_seq_sliding = blocks_per_sequence(cfg, MAX_MODEL_LEN, 0, WINDOW)
    assert per_seq_sliding == -(-(WINDOW - 1 + CHUNK + 1) // BS) + 1 < per_seq_full
    # the CPU default: max_num_seqs sequences, each group at its own need per sequence
    assert [g.num_blocks for g in layout.groups] == [4 * per_seq_full, 4 * per_seq_sliding]
    from transformers import AutoConfig

    layer_bytes = ModelRunner.kv_bytes_per_block(AutoConfig.from_pretrained(target), BS, torch.float32) // \
        (len(full_layers) + len(sliding_layers))
    assert [g.bytes_per_block for g in layout.groups] == [len(full_layers) * layer_bytes,
                                                          len(sliding_layers) * layer_bytes]
    runner = llm.engine.executor.driver_worker.runner
    assert [c.shape[1] for c in runner.kv_caches] == [layout.groups[layout.layer_groups(len(runner.kv_caches))[i]]
                                                      .num_blocks for i in range(len(runner.kv_caches))]


def test_a_long_generation_frees_sliding_blocks_while_full_ones_grow(family, batch):
    _, target, _, reference = family
    llm = LLM(model=target, **engine_args())
    engine = llm.engine
    full, sliding = engine.kv.groups
    prompts = batch[0][:3]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True))
    most_sliding, most_full, outputs = 0, 0, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        for r in engine.scheduler.running:
            if r.num_computed_tokens >= r.num_prompt_tokens:  # decoding
                most_sliding = max(most_sliding, live(sliding.req_blocks[r.request_id]))
                most_full = max(most_full, live(full.req_blocks[r.request_id]))
    # a decoding request holds the blocks its window spans (8 keys: up to 3 blocks of 4) and the one
    # its next token goes to; its full-attention blocks hold the whole sequence
    assert 0 < most_sliding <= -(-WINDOW // BS) + 2
    assert most_full == -(-(max(len(p) for p in prompts) + NUM_NEW - 1) // BS) > 3 * most_sliding
    assert [outputs[str(i)] for i in range(len(prompts))] == [reference(p) for p in prompts]
    assert_no_leaks(llm)


def test_preemption_and_prefix_caching(family, batch):
    """The least KV the engine accepts (one sequence in every group) for a batch: requests are
    preempted and recomputed; prompts sharing a prefix hit the cache, whose sliding blocks before
    the window were freed."""
    _, target, _, reference = family
    probe = LLM(model=target, **engine_args())
    bytes_per_seq = sum(g.bytes_per_block * blocks_per_sequence(probe.engine.config, MAX_MODEL_LEN, 0, g.window)
                        for g in probe.engine.runtime_plan.kv_layout.groups)
    llm = LLM(model=target, **engine_args(kv_cache_memory=bytes_per_seq))
    assert_matches(llm, batch[0], reference)
    assert llm.get_metrics()["num_preemptions"] > 0
    assert_no_leaks(llm)
    hits = llm.get_metrics()["prefix_cache_hits"]
    shared = batch[1]
    assert_matches(llm, shared[:1], reference)
    assert_matches(llm, shared[1:], reference)
    assert llm.get_metrics()["prefix_cache_hits"] - hits >= len(shared) - 1
    assert_no_leaks(llm)


@pytest.mark.parametrize("method", ["draft_model", "ngram", "draft_model_auto", "draft_model_tree"])
def test_speculation_equals_plain(method, family, batch, monkeypatch):
    """``draft_model_auto``: K planned from start-up timings, whose probe forwards run on every
    group's pool; ``draft_model_tree``: an accepted path off the first children moves its KV in
    every group."""
    _, target, draft, reference = family
    spec = {"draft_model": {"method": "draft_model", "model": draft, "num_speculative_tokens": 3},
            "ngram": {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                      "num_speculative_tokens": 3},
            "draft_model_auto": {"method": "draft_model", "model": draft, "num_speculative_tokens": "auto"},
            "draft_model_tree": {"method": "draft_model", "model": draft, "num_speculative_tokens": 3,
                                 "tree_topk": 2, "tree_nodes": 6}}[method]
    llm = LLM(model=target, **engine_args(speculative_config=spec))
    assert llm.engine.kv.groups[1].sliding_window == WINDOW  # the freeing is on
    moved = []  # per tree step that moved an accepted path: slots moved in the sliding group
    move_kv = ModelRunner.move_kv
    monkeypatch.setattr(ModelRunner, "move_kv", lambda runner, src, dst, group_slots=():
                        moved.append(sum(len(s) for s, _ in group_slots) if src else None)
                        or move_kv(runner, src, dst, group_slots))
    prompts = batch[0] + batch[1]
    params = [greedy_params(NUM_NEW, use_speculation=bool(i % 3)) for i in range(len(prompts))]
    assert_matches(llm, prompts, reference, params)
    metrics = llm.get_metrics()
    if method != "draft_model_auto":  # "auto" may plan K = 0 for a draft as large as the target
        assert metrics["num_draft_tokens"] > 0 and metrics["num_accepted_tokens"] > 0
    if method == "draft_model_tree":  # paths off the first children were accepted and moved in both groups
        assert [m for m in moved if m is not None] and all(m for m in moved if m is not None), moved
    assert_no_leaks(llm)


def test_a_sliding_draft_keeps_its_layers_in_the_groups_of_their_windows(family, batch):
    """A draft of the target's family (the same windows): its sliding layers read the sliding
    group's tables, whose blocks are freed behind the window once the draft has caught up, and
    the budget counts its layers in their groups. Greedy speculative output == transformers'."""
    name, target, draft, reference = family
    k = 3
    llm = LLM(model=target, **engine_args(speculative_config={"method": "draft_model", "model": draft,
                                                              "num_speculative_tokens": k}))
    engine = llm.engine
    layout = engine.runtime_plan.kv_layout
    draft_sliding = {"gemma3": (0, 1), "gpt_oss": (0,)}[name]
    draft_full = {"gemma3": (2,), "gpt_oss": (1,)}[name]
    assert [(g.window, g.draft_layers) for g in layout.groups] == [(None, draft_full), (WINDOW, draft_sliding)]
    window_group = layout.groups[1]
    target_layer_bytes = window_group.bytes_per_block // len(window_group.draft_layers + window_group.layers)
    assert [g.bytes_per_block for g in layout.groups] == [
        target_layer_bytes * (len(g.layers) + len(g.draft_layers)) for g in layout.groups]  # a copy: equal layers
    worker = engine.executor.driver_worker
    assert [c.shape[1] for c in worker.draft_runner.kv_caches] == [
        layout.groups[1 if i in draft_sliding else 0].num_blocks for i in range(len(draft_sliding + draft_full))]
    full, sliding = engine.kv.groups
    assert sliding.holds_draft  # frees behind the draft
    prompts = batch[0][:3]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True))
    most_sliding, num_checked, outputs = 0, 0, {}
    while engine.has_unfinished_requests():
        caught_up = set(sliding.req_draft_mark)  # the draft caught up before this step: its blocks move
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        for r in engine.scheduler.running:
            if r.request_id in caught_up:
                most_sliding = max(most_sliding, live(sliding.req_blocks[r.request_id]))
                num_checked += 1
    # behind the draft's last catch-up (one step back: at most K + 1 tokens), the window's keys, the
    # next token's and its drafts' slots
    assert num_checked and 0 < most_sliding <= -(-(WINDOW + k + 1) // BS) + 2
    assert most_sliding < -(-(min(len(p) for p in prompts) + NUM_NEW) // BS)
    assert [outputs[str(i)] for i in range(len(prompts))] == [reference(p) for p in prompts]
    assert llm.get_metrics()["num_accepted_tokens"] > 0
    assert_no_leaks(llm)
    metrics = llm.get_metrics()["kv_cache_groups"]
    assert set(metrics) == {"full_attention", f"sliding_window_{WINDOW}"}
    assert all(m["num_free_blocks"] == m["num_blocks"] and m["usage"] == 0.0 for m in metrics.values())


def test_a_draft_that_is_the_target_accepts_every_draft_while_its_sliding_blocks_are_freed(family, batch):
    """The target as its own draft (float32, greedy) proposes the target's own tokens, so every
    draft is accepted only if the draft's sliding layers read the right keys: a draft catching up
    on a prompt (or a prefix hit) after its window's blocks were freed would not (negative control:
    freeing behind the target instead of behind the draft, the Gemma 3 case accepts 198 of 244)."""
    _, target, _, reference = family
    llm = LLM(model=target, **engine_args(speculative_config={"method": "draft_model", "model": target,
                                                              "num_speculative_tokens": 3}))
    prompts = batch[0][:3] + batch[1]  # the last three share a prefix: hits in every group
    assert_matches(llm, prompts, reference)
    metrics = llm.get_metrics()
    assert metrics["prefix_cache_hits"] > 0
    assert metrics["num_accepted_tokens"] >= 0.95 * metrics["num_draft_tokens"] > 0
    assert_no_leaks(llm)
