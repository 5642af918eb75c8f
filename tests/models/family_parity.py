"""Checks every model family runs against transformers (float32, tiny random checkpoints):
greedy output token-identical to transformers' ``generate`` in ragged batches, plain, with
chunked prefill, prefix-cache hits and preemption, and with speculation (a small draft of the
same family, a noisy copy of the target, n-gram). Imported by the per-family test files."""
from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from specdec import LLM, SamplingParams
from specdec.worker.model_runner import ModelRunner

ENGINE = dict(dtype="float32", device="cpu")


class HFGreedy:
    """transformers' greedy continuation of a prompt (``num_new`` tokens, EOS ignored), cached."""

    def __init__(self, path: str, num_new: int):
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None
        self.num_new = num_new
        self.cache: dict[tuple[int, ...], list[int]] = {}

    def __call__(self, ids: list[int]) -> list[int]:
        key = tuple(ids)
        if key not in self.cache:
            with torch.no_grad():
                out = self.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                          do_sample=False, max_new_tokens=self.num_new, min_new_tokens=self.num_new,
                                          eos_token_id=None, pad_token_id=0)
            self.cache[key] = out[0, len(ids):].tolist()
        return self.cache[key]


def greedy_params(num_new: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True, **kw)


def assert_matches(llm: LLM, prompts: list[list[int]], reference: HFGreedy, params=None) -> list:
    outs = llm.generate([list(p) for p in prompts], params or greedy_params(reference.num_new), use_tqdm=False)
    for out, ids in zip(outs, prompts):
        assert out.outputs[0].token_ids == reference(ids), f"prompt {ids[:8]}... diverged from transformers"
    return outs


def assert_no_leaks(llm: LLM) -> None:
    pool = llm.engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)


def kv_budget(paths: list[str], block_size: int, num_blocks: int) -> int:
    """kv_cache_memory for ``num_blocks`` blocks of every model in ``paths`` (target, drafts)."""
    return num_blocks * sum(ModelRunner.kv_bytes_per_block(AutoConfig.from_pretrained(p), block_size, torch.float32)
                            for p in paths)


def check_plain_chunked_and_prefix_cached(path: str, prompts, shared_prefix_prompts, reference: HFGreedy,
                                          max_model_len: int, chunk_budget: int = 16, **engine) -> None:
    """A ragged batch; the same with a small token budget (chunked prefill); prompts sharing a
    prefix, run twice so the second run hits the prefix cache. ``engine``: more LLM arguments."""
    llm = LLM(model=path, **ENGINE, max_model_len=max_model_len, block_size=8, **engine)
    assert_matches(llm, prompts, reference)
    hits = llm.get_metrics()["prefix_cache_hits"]
    assert_matches(llm, shared_prefix_prompts[:1], reference)
    assert_matches(llm, shared_prefix_prompts, reference)
    assert llm.get_metrics()["prefix_cache_hits"] - hits >= len(shared_prefix_prompts) - 1
    assert_no_leaks(llm)
    chunked = LLM(model=path, **ENGINE, max_model_len=max_model_len, max_num_batched_tokens=chunk_budget,
                  enable_prefix_caching=False, **engine)
    assert_matches(chunked, prompts, reference)


def check_preemption(path: str, prompts, reference: HFGreedy, max_model_len: int, draft: str | None = None,
                     k: int = 3, keep_all_blocks: bool = False) -> None:
    """The least KV the engine accepts (one full-length sequence) for a batch: requests are
    preempted and recomputed, with prefix caching on, and speculation when ``draft`` is given.
    ``keep_all_blocks``: do not free blocks behind sliding windows (with the freeing an
    all-sliding model may fit the batch without preempting)."""
    bs = 8
    num_blocks = -(-(max_model_len + (k if draft else 0) + 1) // bs)
    spec = {"speculative_config": {"method": "draft_model", "model": draft, "num_speculative_tokens": k}} \
        if draft else {}
    llm = LLM(model=path, **ENGINE, max_model_len=max_model_len, block_size=bs,
              kv_cache_memory=kv_budget([path] + ([draft] if draft else []), bs, num_blocks), **spec)
    assert llm.engine.kv.pool.num_blocks == num_blocks
    if keep_all_blocks:
        llm.engine.kv.sliding_window = None
    assert_matches(llm, prompts, reference)
    assert llm.get_metrics()["num_preemptions"] > 0
    assert_no_leaks(llm)


def check_speculative(path: str, prompts, reference: HFGreedy, max_model_len: int, speculative_config: dict,
                      expect_accepted: bool = True) -> None:
    """Speculation is greedy-identical to transformers; some requests of the batch run without it."""
    llm = LLM(model=path, **ENGINE, max_model_len=max_model_len, speculative_config=speculative_config)
    params = [greedy_params(reference.num_new, use_speculation=bool(i % 3)) for i in range(len(prompts))]
    assert_matches(llm, prompts, reference, params)
    metrics = llm.get_metrics()
    assert metrics["num_draft_tokens"] > 0
    if expect_accepted:
        assert metrics["num_accepted_tokens"] > 0
    assert_no_leaks(llm)


def check_tensor_parallel(path: str, prompts, reference: HFGreedy, max_model_len: int) -> None:
    """Two ranks over gloo (each holds half the heads and of the MLP) decode as transformers does."""
    llm = LLM(model=path, **ENGINE, max_model_len=max_model_len, tensor_parallel_size=2)
    try:
        assert_matches(llm, prompts, reference)
        assert_no_leaks(llm)
    finally:
        llm.engine.executor.shutdown()
