"""A model whose every layer slides (Mistral with ``sliding_window``): token-identical to
transformers with the window cutting, and the KV blocks behind the window go back to the pool as
requests advance, so a KV budget that preempts without the freeing preempts less with it."""
from __future__ import annotations

import pytest
from family_parity import ENGINE, HFGreedy, assert_matches, assert_no_leaks, check_speculative, kv_budget

from specdec import LLM, SamplingParams

WINDOW = 8
NUM_NEW = 24
MAX_MODEL_LEN = 96


@pytest.fixture(scope="module")
def target(make_model):
    return make_model("mistral_window", arch="mistral", sliding_window=WINDOW, initializer_range=0.05,
                      random_norms_and_biases=True)


@pytest.fixture(scope="module")
def sliding_draft(make_model):
    return make_model("mistral_window_draft", arch="mistral", num_layers=1, hidden_size=32, num_heads=2,
                      num_kv_heads=1, intermediate_size=64, sliding_window=WINDOW, seed=7)


@pytest.fixture(scope="module")
def reference(target):
    return HFGreedy(target, NUM_NEW)


@pytest.fixture(scope="module")
def batch(tiny_tokenizer, prompts):
    encoded = [tiny_tokenizer.encode(p) for p in prompts[:10]]
    assert max(len(p) for p in encoded) > 2 * WINDOW
    return encoded


def live_blocks(llm: LLM) -> int:
    return sum(b is not None for blocks in llm.engine.kv.req_blocks.values() for b in blocks)


def test_blocks_behind_the_window_are_freed_while_decoding(target, reference, batch):
    llm = LLM(model=target, **ENGINE, max_model_len=MAX_MODEL_LEN, block_size=4)
    assert llm.engine.kv.sliding_window == WINDOW
    engine = llm.engine
    for i, p in enumerate(batch[:3]):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True))
    most, num_steps = 0, 0
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        num_steps += 1
        if num_steps > 1:  # decoding (the first step prefilled whole prompts, up to 15 blocks)
            most = max(most, max((sum(b is not None for b in blocks) for blocks in engine.kv.req_blocks.values()),
                                 default=0))
    # after a step a request holds the blocks its window spans (8 keys: up to 3 blocks of 4) and
    # the one its next token goes to, until the next schedule frees the block that fell out
    assert 0 < most <= -(-WINDOW // 4) + 2
    assert max(len(p) for p in batch[:3]) > 4 * (-(-WINDOW // 4) + 2)  # holding every block would exceed it
    assert [outputs[str(i)] for i in range(3)] == [reference(p) for p in batch[:3]]
    assert_no_leaks(llm)


def test_freeing_behind_the_window_lets_more_requests_run_at_once(target, reference, batch):
    """The least KV the engine accepts (one full-length sequence) for a batch of 10: with the
    freeing, requests share the pool and the batch takes fewer engine steps than the same engine
    told to keep every block (negative control); both decode exactly as transformers."""
    bs = 8
    num_blocks = -(-(MAX_MODEL_LEN + 1) // bs)
    num_steps, most_running = {}, {}
    for keep_all in (False, True):
        llm = LLM(model=target, **ENGINE, max_model_len=MAX_MODEL_LEN, block_size=bs,
                  kv_cache_memory=kv_budget([target], bs, num_blocks))
        if keep_all:
            llm.engine.kv.sliding_window = None
        steps = []
        llm.engine.step_observers.append(lambda record: steps.append(len(llm.engine.scheduler.running)))
        assert_matches(llm, batch, reference)
        num_steps[keep_all], most_running[keep_all] = len(steps), max(steps)
        assert_no_leaks(llm)
    assert most_running[False] > most_running[True] and num_steps[False] < num_steps[True]


@pytest.mark.parametrize("method", ["sliding_draft", "ngram"])
def test_speculation_with_the_freeing(method, target, sliding_draft, reference, batch):
    spec = {"sliding_draft": {"method": "draft_model", "model": sliding_draft, "num_speculative_tokens": 3},
            "ngram": {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                      "num_speculative_tokens": 3}}[method]
    check_speculative(target, batch, reference, MAX_MODEL_LEN, spec, expect_accepted=method == "ngram")


def test_a_draft_that_sees_everything_keeps_every_block(target, make_model):
    """A global-attention draft reads the same block tables: nothing may be freed early."""
    draft = make_model("llama_global_draft", arch="llama", num_layers=1, hidden_size=32, num_heads=2,
                       num_kv_heads=1, intermediate_size=64, seed=7)
    llm = LLM(model=target, **ENGINE, max_model_len=MAX_MODEL_LEN,
              speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 2})
    assert llm.engine.kv.sliding_window is None
