"""Shared checks for the mixture-of-experts families (imported by test_qwen3_moe.py, test_mixtral.py).

Tiny random checkpoints built by transformers (``router_scale``: rows pick different experts);
every check runs float32 on CPU against transformers' own model (logits; greedy tokens).
"""
from __future__ import annotations

import torch

from specdec import LLM, SamplingParams
from specdec.layers.moe import moe_layers

ENGINE = dict(dtype="float32", device="cpu")
NUM_NEW_TOKENS = 24
PROMPTS = [
    "def f(x):",
    "a",
    "class Decoder(object):\n    def __init__(self, *, object_hook=None, parse_float=None):",
    "for i in range(10):",
    "import json",
    "s = json.dumps(obj, indent=4)",
]


class HFGreedy:
    """transformers' greedy continuation of a prompt (NUM_NEW_TOKENS tokens, EOS ignored), cached."""

    def __init__(self, path: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.cache: dict[tuple[int, ...], list[int]] = {}

    def __call__(self, ids: list[int]) -> list[int]:
        if tuple(ids) not in self.cache:
            with torch.no_grad():
                out = self.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                          do_sample=False, max_new_tokens=NUM_NEW_TOKENS,
                                          min_new_tokens=NUM_NEW_TOKENS, eos_token_id=None, pad_token_id=0)
            self.cache[tuple(ids)] = out[0, len(ids):].tolist()
        return self.cache[tuple(ids)]


def greedy_params(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, **kw)


def token_ids(llm: LLM, prompts: list[list[int]], params=None) -> list[list[int]]:
    outs = llm.generate([list(p) for p in prompts], params or greedy_params(), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def assert_no_leaks(llm: LLM) -> None:
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_blocks


def check_logits(path: str, hf: HFGreedy) -> None:
    """Full-prompt logits of a ragged batch within 1e-4 (relative) of transformers'; routing varies."""
    llm = LLM(model=path, **ENGINE, max_model_len=256)
    runner = llm.engine.executor.driver_worker.runner
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS[:3]] + [list(range(3, 83))]
    tables, start = [], 0
    for ids in prompts:
        n = -(-len(ids) // runner.block_size)
        tables.append(list(range(start, start + n)))
        start += n
    batch = runner.prepare(prompts, [0] * len(prompts), tables, [list(range(len(p))) for p in prompts])
    layers = moe_layers(runner.model)
    assert layers, "no MoE layer in the model"
    for layer in layers:
        layer.stats.reset()
    logits = runner.forward(batch).clone()
    # routing is exercised: a layer's rows together touch most experts
    assert min(m.stats.last_experts_read for m in layers) >= 0.75 * layers[0].gate.num_experts
    row = 0
    with torch.no_grad():
        for ids in prompts:
            ref = hf.model(torch.tensor([ids])).logits[0].float()
            ours = logits[row:row + len(ids)]
            row += len(ids)
            err, scale = (ours - ref).abs().max().item(), ref.abs().max().item()
            assert err <= 1e-4 * scale, f"max |ours - hf| = {err:.3g} vs max |hf| = {scale:.3g}"


def check_greedy_mixed_batch(path: str, hf: HFGreedy, tokenizer) -> None:
    """A ragged batch, prefix caching on and hit (a second round over the same prompts)."""
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    llm = LLM(model=path, **ENGINE, max_model_len=256, block_size=8, enable_prefix_caching=True)
    assert token_ids(llm, prompts) == [hf(p) for p in prompts]
    hits = llm.get_metrics()["prefix_cache_hits"]
    assert token_ids(llm, prompts[::-1]) == [hf(p) for p in prompts[::-1]]
    assert llm.get_metrics()["prefix_cache_hits"] > hits
    assert_no_leaks(llm)


def check_preemption(path: str, hf: HFGreedy, tokenizer, expect_preemption: bool = True) -> None:
    """The least KV the engine accepts (one full-length sequence) for a batch of six; a sliding
    window frees blocks behind it, so there the batch may fit without preempting."""
    from transformers import AutoConfig

    from specdec.worker.model_runner import ModelRunner

    block_bytes = ModelRunner.kv_bytes_per_block(AutoConfig.from_pretrained(path), 8, torch.float32)
    llm = LLM(model=path, **ENGINE, max_model_len=112, block_size=8, kv_cache_memory=15 * block_bytes)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    assert token_ids(llm, prompts) == [hf(p) for p in prompts]
    assert llm.get_metrics()["num_preemptions"] > 0 or not expect_preemption
    assert_no_leaks(llm)


def check_speculative(path: str, draft: str, hf: HFGreedy, tokenizer) -> None:
    """Greedy speculative (a draft model, K = 3; then n-gram) == transformers' greedy, in a batch
    where greedy, sampled and non-speculative requests verify together."""
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    for spec in ({"method": "draft_model", "model": draft, "num_speculative_tokens": 3},
                 {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3, "num_speculative_tokens": 3}):
        llm = LLM(model=path, **ENGINE, max_model_len=256, speculative_config=spec)
        batch, params = [], []
        for i, p in enumerate(prompts):
            batch += [p, p]
            params += [greedy_params(use_speculation=i % 3 != 0),
                       SamplingParams(temperature=0.8, seed=i, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)]
        outs = token_ids(llm, batch, params)
        assert outs[::2] == [hf(p) for p in prompts]
        m = llm.get_metrics()
        assert m["num_draft_tokens"] > 0 and m["num_accepted_tokens"] > 0
        assert_no_leaks(llm)
