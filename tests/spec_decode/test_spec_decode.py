"""Speculative decoding end to end (float32): greedy output is token-identical to plain greedy
decoding, whatever the proposer, K, batch mix, stop condition, preemption or abort.

The reference is the same target run without speculation. Drafts: the target itself (every
guess right), the target's weights plus noise (about half right: accept and reject paths
both run) and an unrelated model (mostly wrong).
"""
from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from specdec import LLM, SamplingParams
from specdec.config import SpeculativeConfig
from specdec.worker.model_runner import ModelRunner

ENGINE = dict(dtype="float32", device="cpu", max_model_len=128)
MAX_TOKENS = 24


def greedy(max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=kw.pop("ignore_eos", True), **kw)


def spec_llm(target: str, draft: str, k: int, tree: dict | None = None, **kw) -> LLM:
    return LLM(model=target, **{**ENGINE, **kw},
               speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": k, **(tree or {})})


@pytest.fixture(scope="module")
def reference(llama_path, prompts) -> dict[str, list[int]]:
    llm = LLM(model=llama_path, **ENGINE)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    return {p: o.outputs[0].token_ids for p, o in zip(prompts, outs)}


def assert_no_leaks(llm: LLM) -> None:
    engine = llm.engine
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in engine.kv.pool.blocks)
    assert not engine.has_unfinished_requests() and not engine.groups and not engine.kv.req_blocks


@pytest.mark.parametrize("draft, k", [("noisy", 1), ("noisy", 3), ("noisy", 5), ("noisy", 8), ("other", 3),
                                      ("padded_vocab", 2)])
def test_greedy_is_identical_in_mixed_batches(draft, k, llama_path, noisy_draft_path, other_draft_path, make_model,
                                              prompts, reference):
    drafts = {"noisy": noisy_draft_path, "other": other_draft_path}
    if draft == "padded_vocab":  # same tokenizer, embedding rows padded past it (384 > 320): logits are sliced
        drafts[draft] = make_model("padded_vocab_draft", arch="mistral", vocab_size=384, num_layers=1, seed=9)
    llm = spec_llm(llama_path, drafts[draft], k)
    assert len(prompts) >= 20
    sampled = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=MAX_TOKENS, ignore_eos=True)
               for i in range(6)]
    opted_out = [greedy(use_speculation=False) for _ in range(6)]
    # interleave: greedy, sampled and opted-out requests verify in the same target forward
    batch = [(p, greedy(), "greedy") for p in prompts]
    for i in range(6):
        batch.insert(4 * i + 1, (prompts[i], sampled[i], "sampled"))
        batch.insert(4 * i + 3, (prompts[-1 - i], opted_out[i], "opted_out"))
    outs = llm.generate([p for p, _, _ in batch], [sp for _, sp, _ in batch], use_tqdm=False)
    for (prompt, _, kind), out in zip(batch, outs):
        c = out.outputs[0]
        assert len(c.token_ids) == MAX_TOKENS and c.finish_reason == "length"
        if kind != "sampled":
            assert c.token_ids == reference[prompt], f"{kind} request for {prompt!r} diverged (K={k})"
        if kind == "opted_out":
            assert out.metrics.spec_decode.num_drafts == 0
    m = llm.get_metrics()
    assert m["num_draft_tokens"] > 0 and max(m["k_histogram"]) <= k
    if draft == "noisy":  # both verification outcomes really happened
        assert 0.0 < m["acceptance_rate"] < 1.0
    assert_no_leaks(llm)


def test_draft_equal_to_target_accepts_every_greedy_guess(llama_path, prompts, reference):
    llm = spec_llm(llama_path, llama_path, 5)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [reference[p] for p in prompts]
    m = llm.get_metrics()
    assert m["num_draft_tokens"] > 0 and m["acceptance_rate"] == 1.0
    assert m["mean_acceptance_length"] > 4.0
    assert all(o.metrics.spec_decode.acceptance_rate == 1.0 for o in outs)


def first_occurrences_in_first_run(reference, accept, first=2, last=8):
    """(prompt, ids, j): ids[j] first occurs at j, inside the first speculative run (tokens 1..9 for K=8)."""
    for prompt, ids in reference.items():
        for j in range(first, last + 1):
            if ids[j] not in ids[:j] and accept(ids[j]):
                yield prompt, ids, j


def test_stops_inside_an_accepted_run_cut_exactly_there(llama_path, reference, make_copy_with_eos, tmp_path):
    llm = spec_llm(llama_path, llama_path, 8)  # every draft accepted: runs of 9 tokens per step
    tok = llm.tokenizer
    prompt, ids, j = next(first_occurrences_in_first_run(reference, lambda t: tok.decode([t]) != ""))
    (out,) = llm.generate([prompt], greedy(stop_token_ids=[ids[j]]), use_tqdm=False)
    c = out.outputs[0]
    assert c.token_ids == ids[: j + 1] and (c.finish_reason, c.stop_reason) == ("stop", ids[j])
    assert c.text == tok.decode(ids[:j])
    assert out.metrics.spec_decode.num_accepted_tokens >= j  # the stop really fell inside an accepted run

    def clean(t):
        s = tok.decode([t])
        return s.strip() != "" and s.isascii() and s.isprintable()

    for prompt, ids, j in first_occurrences_in_first_run(reference, clean):
        stop = tok.decode([ids[j]])
        if tok.decode(ids[: j + 1]).find(stop) == len(tok.decode(ids[:j])):
            break
    else:
        pytest.fail("no clean ASCII token inside a first speculative run")
    (out,) = llm.generate([prompt], greedy(stop=[stop]), use_tqdm=False)
    c = out.outputs[0]
    assert c.token_ids == ids[: j + 1] and (c.finish_reason, c.stop_reason) == ("stop", stop)
    assert c.text == tok.decode(ids[:j])

    prompt, ids, j = next(first_occurrences_in_first_run(reference, lambda t: True))
    eos_path = make_copy_with_eos(llama_path, tmp_path / "eos", ids[j])
    eos_llm = spec_llm(eos_path, eos_path, 8)
    (out,) = eos_llm.generate([prompt], greedy(ignore_eos=False), use_tqdm=False)
    c = out.outputs[0]
    assert c.token_ids == ids[: j + 1] and (c.finish_reason, c.stop_reason) == ("stop", None)
    assert_no_leaks(llm)
    assert_no_leaks(eos_llm)


def test_max_tokens_and_max_model_len_are_never_exceeded(llama_path, noisy_draft_path, reference, prompts):
    llm = spec_llm(llama_path, llama_path, 8)
    prompt = prompts[0]
    outs = llm.generate([prompt] * 12, [greedy(m) for m in range(1, 13)], use_tqdm=False)
    for m, out in zip(range(1, 13), outs):
        assert out.outputs[0].token_ids == reference[prompt][:m] and out.outputs[0].finish_reason == "length"
    # the context limit: a 60-token prompt under max_model_len 64 leaves room for exactly 4 tokens
    long_prompt = list(range(3, 63))
    plain = LLM(model=llama_path, **{**ENGINE, "max_model_len": 64})
    (want,) = plain.generate([long_prompt], greedy(), use_tqdm=False)
    assert len(want.outputs[0].token_ids) == 4
    for draft in (llama_path, noisy_draft_path):
        (got,) = spec_llm(llama_path, draft, 8, max_model_len=64).generate([long_prompt], greedy(), use_tqdm=False)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].finish_reason == "length"


def test_no_kv_leaks_after_many_speculative_requests_with_aborts(llama_path, noisy_draft_path, prompts, reference):
    llm = spec_llm(llama_path, noisy_draft_path, 4, max_num_seqs=4)  # most requests wait their turn
    engine = llm.engine
    kinds = [greedy(), SamplingParams(temperature=1.0, seed=5, max_tokens=20, ignore_eos=True),
             SamplingParams(n=2, temperature=0.7, max_tokens=16, ignore_eos=True), greedy(use_speculation=False)]
    finished: dict[str, object] = {}

    def step(times: int) -> None:
        for _ in range(times):
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out

    aborted: set[str] = set()

    def abort(ids: list[str]) -> None:
        aborted.update(set(ids) - set(finished))  # aborting a finished request is a no-op
        engine.abort_request(ids)

    for i, p in enumerate(prompts[:10]):
        engine.add_request(f"a{i}", llm.tokenizer.encode(p), kinds[i % 4], prompt=p)
    step(3)
    assert engine.scheduler.waiting and engine.scheduler.running
    abort(["a0", "a5", "a9"])  # running and waiting ones
    for i, p in enumerate(prompts[10:16]):
        engine.add_request(f"b{i}", llm.tokenizer.encode(p), kinds[i % 4], prompt=p)
    step(4)
    abort(["a2", "b1", "b5"])
    step(1)
    abort(["a6", "b2"])
    while engine.has_unfinished_requests():
        step(1)
    assert len(aborted) >= 6 and not aborted & set(finished)
    assert set(finished) == ({f"a{i}" for i in range(10)} | {f"b{i}" for i in range(6)}) - aborted
    for rid, out in finished.items():
        i, batch = int(rid[1:]), prompts[:10] if rid[0] == "a" else prompts[10:16]
        if i % 4 in (0, 3):  # greedy, with or without speculation
            assert out.outputs[0].token_ids == reference[batch[i]]
    assert llm.get_metrics()["num_draft_tokens"] > 0
    assert_no_leaks(llm)


@pytest.mark.parametrize("tree", [None, {"tree_topk": 3, "tree_nodes": 10}], ids=["chain", "tree"])
def test_preemption_with_speculation_keeps_greedy_identical(tree, llama_path, noisy_draft_path, prompts, reference):
    bs, max_model_len, k = 8, 96, 4
    slots = SpeculativeConfig(method="draft_model", model=noisy_draft_path, num_speculative_tokens=k,
                              **(tree or {})).num_spec_slots  # a tree reserves a slot per node
    block_bytes = (ModelRunner.kv_bytes_per_block(AutoConfig.from_pretrained(llama_path), bs, torch.float32)
                   + ModelRunner.kv_bytes_per_block(AutoConfig.from_pretrained(noisy_draft_path), bs, torch.float32))
    num_blocks = -(-(max_model_len + slots + 1) // bs)  # the least the engine accepts: one full-length sequence
    llm = spec_llm(llama_path, noisy_draft_path, k, tree, max_model_len=max_model_len, block_size=bs,
                   kv_cache_memory=num_blocks * block_bytes)
    assert llm.engine.kv.pool.num_blocks == num_blocks
    outs = llm.generate(prompts[:12], greedy(), use_tqdm=False)
    assert llm.get_metrics()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outs] == [reference[p] for p in prompts[:12]]
    assert_no_leaks(llm)


def test_ngram_proposer_is_greedy_identical(llama_path, prompts, reference):
    llm = LLM(model=llama_path, **ENGINE, speculative_config={
        "method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3, "num_speculative_tokens": 3})
    mixed = [greedy() if i % 3 else greedy(use_speculation=False) for i in range(len(prompts))]
    outs = llm.generate(prompts, mixed, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [reference[p] for p in prompts]
    m = llm.get_metrics()
    assert m["method"] == "ngram" and m["num_accepted_tokens"] > 0
    assert_no_leaks(llm)


def test_seeded_sampled_request_with_speculation_is_independent_of_the_batch(llama_path, noisy_draft_path, prompts):
    seeded = SamplingParams(temperature=1.0, seed=99, max_tokens=20, ignore_eos=True)
    llm = spec_llm(llama_path, noisy_draft_path, 3)
    (alone,) = llm.generate([prompts[2]], seeded, use_tqdm=False)
    others = [SamplingParams(temperature=0.7, max_tokens=12, ignore_eos=True), greedy(),
              SamplingParams(temperature=1.0, seed=1, max_tokens=20, ignore_eos=True)]
    outs = llm.generate(prompts[:6] + [prompts[2]], others * 2 + [seeded], use_tqdm=False)
    assert outs[-1].outputs[0].token_ids == alone.outputs[0].token_ids


SHARED_PREFIX = ("def dedent(text):\n    \"\"\"Remove any common leading whitespace from every\n"
                 "    line in `text`.\n    \"\"\"\n")


def test_prefix_hits_and_chunked_prefill_with_speculation(llama_path, noisy_draft_path):
    """Prefix-cache hits (the draft recomputes its own KV for shared blocks) and prefill chunks
    sharing a small token budget with verification rows."""
    prompts = [SHARED_PREFIX + tail for tail in ("    margin = None", "    lines = []", "    return", "x")]
    plain = LLM(model=llama_path, **ENGINE, enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy(), use_tqdm=False)]
    llm = spec_llm(llama_path, noisy_draft_path, 4, block_size=8, max_num_batched_tokens=24)
    assert max(len(llm.tokenizer.encode(p)) for p in prompts) > 24  # prompts arrive in chunks
    first = llm.generate(prompts[:1], greedy(), use_tqdm=False)
    assert first[0].outputs[0].token_ids == want[0]
    for _ in range(2):  # the second call also hits blocks holding generated tokens
        outs = llm.generate(prompts, greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert all(o.metrics.num_cached_tokens >= 16 for o in outs)
    m = llm.get_metrics()
    assert m["prefix_cache_hits"] >= 8 and m["num_accepted_tokens"] > 0
    assert_no_leaks(llm)



def test_logprobs_with_speculation_match_plain_decoding(llama_path, noisy_draft_path, prompts):
    params = greedy(logprobs=3)
    plain = LLM(model=llama_path, **ENGINE).generate(prompts[:6], params, use_tqdm=False)
    spec = spec_llm(llama_path, noisy_draft_path, 4).generate(prompts[:6], params, use_tqdm=False)
    for a, b in zip(plain, spec):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for da, db in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert da.keys() == db.keys()
            assert all(abs(da[t] - db[t]) < 1e-4 for t in da)
        assert b.outputs[0].cumulative_logprob == pytest.approx(a.outputs[0].cumulative_logprob, abs=1e-3)



def test_penalties_and_min_tokens_with_speculation_match_plain_decoding(llama_path, noisy_draft_path, prompts,
                                                                        reference, make_copy_with_eos, tmp_path):
    """Verification row i of a request must see the drafts before it as output (penalties) and
    ban EOS while num_output + i < min_tokens."""
    prompt, ids = next((p, ids) for p, ids in reference.items() if ids[4] not in ids[:4])
    eos_path = make_copy_with_eos(llama_path, tmp_path / "eos", ids[4])  # greedy would stop at token 4
    params = [greedy(ignore_eos=False, min_tokens=10),
              greedy(repetition_penalty=1.3, frequency_penalty=0.3, presence_penalty=0.4),
              greedy(ignore_eos=False, min_tokens=6, repetition_penalty=1.1)]
    batch = [prompt] * 3 + prompts[:3]
    plain = LLM(model=eos_path, **ENGINE).generate(batch, params * 2, use_tqdm=False)
    assert len(plain[0].outputs[0].token_ids) >= 10 and ids[4] not in plain[0].outputs[0].token_ids[:10]
    spec = spec_llm(eos_path, noisy_draft_path, 4).generate(batch, params * 2, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
