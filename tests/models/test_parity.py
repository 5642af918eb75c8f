"""Parity with Hugging Face transformers on tiny random checkpoints of every architecture.

float32 logits within 1e-4 (relative to the logits' scale) of the reference forward, and
greedy generation of 32 tokens token-identical to ``transformers`` ``generate`` for a ragged
batch of prompts: plain, with prefix-cache hits, with chunked prefill on and off, and under
preemption. Norms and biases are randomised so that a norm or bias that is skipped or
misloaded shows up.
"""
from __future__ import annotations

import pytest
import torch

from specdec import LLM, SamplingParams

ENGINE = dict(dtype="float32", device="cpu")
NUM_NEW_TOKENS = 32
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

# name -> make_tiny_model kwargs. Together: GQA, MQA and MHA; tied and untied embeddings;
# llama3 rope scaling; QKV bias; q/k norm with head_dim != hidden / heads; sharded weights.
VARIANTS = {
    "llama_gqa_untied": None,  # the session's default target (conftest llama_path)
    "llama3_rope_tied": dict(arch="llama", tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE, rope_theta=500000.0),
    "mistral_mqa_sharded": dict(arch="mistral", num_kv_heads=1, max_shard_size="40KB"),
    "qwen2_qkv_bias_tied": dict(arch="qwen2", tie_word_embeddings=True),
    "qwen3_qk_norm_mha": dict(arch="qwen3", num_kv_heads=4, head_dim=32),
}

GEN_PROMPTS = [
    "def f(x):",
    "a",
    "class Decoder(object):\n    def __init__(self, *, object_hook=None, parse_float=None):",
    "for i in range(10):",
    "import json",
]


@pytest.fixture(scope="module")
def variant_path(make_model, llama_path):
    def get(name: str) -> str:
        if VARIANTS[name] is None:
            return llama_path
        return make_model(f"parity_{name}", initializer_range=0.05, random_norms_and_biases=True, **VARIANTS[name])

    return get


@pytest.fixture(scope="module")
def hf_reference():
    """hf_reference(path) -> (model, greedy(ids) -> 32 new token ids), models and results cached."""
    from transformers import AutoModelForCausalLM

    models, results = {}, {}

    def get(path: str):
        if path not in models:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            model.generation_config.eos_token_id = None  # generate exactly NUM_NEW_TOKENS, EOS or not
            models[path] = model

        def greedy(ids: list[int]) -> list[int]:
            key = (path, tuple(ids))
            if key not in results:
                with torch.no_grad():
                    out = models[path].generate(
                        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                        do_sample=False, max_new_tokens=NUM_NEW_TOKENS, min_new_tokens=NUM_NEW_TOKENS,
                        eos_token_id=None, pad_token_id=0)
                results[key] = out[0, len(ids):].tolist()
            return results[key]

        return models[path], greedy

    return get


def our_logits(llm: LLM, prompts: list[list[int]], chunk: int | None = None) -> list[torch.Tensor]:
    """Full-prompt logits from the engine's model runner for a ragged batch ([L_i, V] each).
    With ``chunk``, prompts are fed in chunks of that size, one forward per chunk round."""
    runner = llm.engine.executor.driver_worker.runner
    bs = runner.block_size
    tables, start = [], 0
    for ids in prompts:  # disjoint blocks per prompt in the fresh engine
        n = -(-len(ids) // bs)
        tables.append(list(range(start, start + n)))
        start += n
    step = chunk or max(len(p) for p in prompts)
    out = [[] for _ in prompts]
    for pos in range(0, max(len(p) for p in prompts), step):
        live = [i for i, p in enumerate(prompts) if pos < len(p)]
        feeds = [prompts[i][pos:pos + step] for i in live]
        batch = runner.prepare(feeds, [pos] * len(live), [tables[i] for i in live],
                               [list(range(len(f))) for f in feeds])
        logits = runner.forward(batch)
        row = 0
        for i, f in zip(live, feeds):
            out[i].append(logits[row:row + len(f)].clone())  # the engine's runner reuses its logits buffer
            row += len(f)
    return [torch.cat(parts) for parts in out]


def assert_close_relative(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> None:
    err = (ours - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= rel * scale, f"max |ours - hf| = {err:.3g} > {rel} * max|hf| = {rel * scale:.3g}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(variant, variant_path, hf_reference):
    path = variant_path(variant)
    model, _ = hf_reference(path)
    llm = LLM(model=path, **ENGINE, max_model_len=256)
    prompts = [llm.tokenizer.encode(p) for p in GEN_PROMPTS[:3]] + [list(range(3, 103))]  # up to 100 tokens
    with torch.no_grad():
        refs = [model(torch.tensor([ids])).logits[0].float() for ids in prompts]
    for ours, ref in zip(our_logits(llm, prompts), refs):
        assert ours.shape == ref.shape
        assert_close_relative(ours, ref)
    # the same prompts fed in chunks of 7 tokens: positions and cached keys must line up
    for ours, ref in zip(our_logits(llm, prompts, chunk=7), refs):
        assert_close_relative(ours, ref)


def run_greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = NUM_NEW_TOKENS):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([list(p) for p in prompts], params, use_tqdm=False)


def assert_matches_hf(outs, prompts, greedy) -> None:
    for out, ids in zip(outs, prompts):
        assert out.outputs[0].token_ids == greedy(ids), f"prompt {ids[:8]}... diverged from transformers"
        assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_generation_matches_transformers(variant, variant_path, hf_reference):
    path = variant_path(variant)
    _, greedy = hf_reference(path)
    llm = LLM(model=path, **ENGINE, max_model_len=256)
    prompts = [llm.tokenizer.encode(p) for p in GEN_PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts)  # a ragged batch
    assert_matches_hf(run_greedy(llm, prompts), prompts, greedy)
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_blocks



def test_ragged_batch_whose_total_looks_uniform(llama_path, hf_reference):
    model, greedy = hf_reference(llama_path)
    llm = LLM(model=llama_path, **ENGINE, max_model_len=256)
    prompts = [[5, 6], [7], [8, 9, 10]]  # 2 + 1 + 3 rows == 2 rows * 3 requests
    with torch.no_grad():
        refs = [model(torch.tensor([ids])).logits[0].float() for ids in prompts]
    for ours, ref in zip(our_logits(llm, prompts), refs):
        assert_close_relative(ours, ref)
    assert_matches_hf(run_greedy(llm, prompts), prompts, greedy)


# ---- one architecture, every scheduling path ----

SHARED_PREFIX = ("def dedent(text):\n    \"\"\"Remove any common leading whitespace from every\n"
                 "    line in `text`.\n    \"\"\"\n")
PREFIX_PROMPTS = [SHARED_PREFIX + tail for tail in ("    margin = None", "    lines = []", "    return", "x")]


def test_prefix_cache_hits_give_the_same_tokens(llama_path, hf_reference):
    _, greedy = hf_reference(llama_path)
    llm = LLM(model=llama_path, **ENGINE, max_model_len=256, block_size=8)
    prompts = [llm.tokenizer.encode(p) for p in PREFIX_PROMPTS]
    assert len(prompts[0]) >= 24
    first = run_greedy(llm, prompts[:1])
    assert_matches_hf(first, prompts[:1], greedy)
    hits_before = llm.get_metrics()["prefix_cache_hits"]
    second = run_greedy(llm, prompts)  # all four share the first call's cached prefix blocks
    assert llm.get_metrics()["prefix_cache_hits"] - hits_before >= len(prompts)
    assert all(o.metrics.num_cached_tokens >= 16 for o in second)
    assert_matches_hf(second, prompts, greedy)
    third = run_greedy(llm, prompts)  # whole prompts (and generated blocks) cached now
    assert all(o.metrics.num_cached_tokens >= 8 * (len(p) // 8) - 8 for o, p in zip(third, prompts))
    assert_matches_hf(third, prompts, greedy)
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_blocks


@pytest.mark.parametrize("chunked", [True, False])
def test_small_token_budget_with_and_without_chunked_prefill(chunked, llama_path, hf_reference):
    _, greedy = hf_reference(llama_path)
    llm = LLM(model=llama_path, **ENGINE, max_model_len=256, max_num_batched_tokens=16,
              enable_chunked_prefill=chunked, enable_prefix_caching=False)
    prompts = [llm.tokenizer.encode(p) for p in GEN_PROMPTS]
    assert max(len(p) for p in prompts) > 16  # the longest prompt needs several chunks (or the raised budget)
    assert_matches_hf(run_greedy(llm, prompts), prompts, greedy)


def test_preemption_gives_the_same_tokens(llama_path, hf_reference):
    _, greedy = hf_reference(llama_path)
    from transformers import AutoConfig

    from specdec.worker.model_runner import ModelRunner

    block_bytes = ModelRunner.kv_bytes_per_block(AutoConfig.from_pretrained(llama_path), 8, torch.float32)
    # one sequence needs ceil((112 + 1) / 8) = 15 blocks: the minimum the engine accepts
    llm = LLM(model=llama_path, **ENGINE, max_model_len=112, block_size=8, kv_cache_memory=15 * block_bytes)
    assert llm.engine.kv.pool.num_blocks == 15
    prompts = [llm.tokenizer.encode(p) for p in GEN_PROMPTS]
    assert_matches_hf(run_greedy(llm, prompts), prompts, greedy)
    assert llm.get_metrics()["num_preemptions"] > 0
    assert llm.engine.kv.pool.num_free_blocks == 15


def test_the_engine_runner_reuses_one_logits_buffer(llama_path):
    """The target runner writes logits into one grown buffer (no fresh [rows, V] float32 tensor
    per step); values equal a runner that allocates, and a larger batch grows the buffer."""
    llm = LLM(model=llama_path, **ENGINE, max_model_len=256)
    runner = llm.engine.executor.driver_worker.runner
    assert runner.reuse_logits
    feeds = [[3, 4, 5, 6], [7, 8, 9]]
    batch = runner.prepare(feeds, [0, 0], [[0], [1]], [list(range(len(f))) for f in feeds])
    first = runner.forward(batch).clone()
    again = runner.forward(batch)
    assert again.data_ptr() == runner.forward(batch).data_ptr()  # the same storage, step after step
    runner.reuse_logits = False
    fresh = runner.forward(batch)
    assert fresh.data_ptr() != again.data_ptr()
    torch.testing.assert_close(first, fresh, rtol=0, atol=0)
    runner.reuse_logits = True
    wide = [[3 + i, 4 + i] for i in range(8)]
    big = runner.forward(runner.prepare(wide, [0] * 8, [[i] for i in range(8)], [[0, 1]] * 8))
    assert big.shape == (16, first.shape[1]) and runner._logits_buf.shape[0] >= 16
