"""Structured output at its edges (float32, tiny random models): EOS and length limits inside
and after a structure, forced tokens at the limits and with logprobs / EAGLE / no speculation,
pruned trees and chains, aborts, the mask kernels' bit and row handling, and the compile cache."""
from __future__ import annotations

import threading

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.spec_decode.proposer import DraftProposal
from specdec.structured_output import StructuredOutputsParams
from specdec.structured_output.grammar_state import GrammarCursor, GrammarState, _bit
from specdec.structured_output.masking import apply_bitmask, unpack_row
from specdec.structured_output.stage import prune_drafts

ENGINE = dict(dtype="float32", device="cpu", max_model_len=128)
CHOICE = StructuredOutputsParams(choice=["import json", "import os"])
LONG = StructuredOutputsParams(regex=r"def [a-z]{20,30}\(\):")  # forced "def " and "():"-like runs


@pytest.fixture(scope="module")
def llm(llama_path):
    return LLM(model=llama_path, **ENGINE)


def _idle(llm: LLM) -> None:
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_blocks
    assert llm.engine.executor.driver_worker.num_request_states() == 0


def _matcher(llm: LLM, params: StructuredOutputsParams):
    import xgrammar as xgr

    return xgr.GrammarMatcher(llm.engine.compile_grammar(params))


# ---- EOS ----
def test_eos_edges(llm, prompts):
    eos = llm.engine.eos_token_ids[0]
    base = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=20, structured_outputs=CHOICE),
                        use_tqdm=False)[0].outputs[0]
    assert base.finish_reason == "stop" and base.text in CHOICE.choice
    n = len(base.token_ids)
    # ignore_eos: the grammar is complete, so only EOS follows, up to max_tokens
    ign = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=n + 4, ignore_eos=True,
                                                    structured_outputs=CHOICE), use_tqdm=False)[0].outputs[0]
    assert ign.finish_reason == "length"
    assert ign.token_ids[:n - 1] == base.token_ids[:n - 1] and set(ign.token_ids[n - 1:]) == {eos}
    # min_tokens past the structure: the only allowed token (EOS) is banned; EOS comes anyway, no crash
    mt = llm.generate([prompts[0]], SamplingParams(temperature=0.7, seed=1, max_tokens=n + 6, min_tokens=n + 3,
                                                   structured_outputs=CHOICE), use_tqdm=False)[0].outputs[0]
    assert mt.text in CHOICE.choice and mt.finish_reason == "stop" and len(mt.token_ids) == n + 3
    # max_tokens inside the structure: "length", then the next request is unaffected
    cut = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=2, structured_outputs=CHOICE,
                                                    logprobs=1), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 2 and len(cut.logprobs) == 2
    assert cut.token_ids == base.token_ids[:2]
    # a stop token id inside the grammar's language stops there
    stop_id = base.token_ids[1]
    st = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id],
                                                   structured_outputs=CHOICE), use_tqdm=False)[0].outputs[0]
    assert st.token_ids == base.token_ids[:2] and st.finish_reason == "stop"
    _idle(llm)


def test_several_eos_ids(llama_path, make_copy_with_eos, tmp_path, prompts):
    # generation_config names token 7 as an EOS besides the tokenizer's: the grammar's end allows both
    path = make_copy_with_eos(llama_path, tmp_path / "eos7", 7)
    llm = LLM(model=path, **ENGINE)
    assert set(llm.engine.eos_token_ids) >= {7, 1}
    outs = llm.generate(prompts[:4], SamplingParams(temperature=1.0, seed=3, max_tokens=20, structured_outputs=CHOICE),
                        use_tqdm=False)
    for o in outs:
        assert o.outputs[0].text in CHOICE.choice and o.outputs[0].finish_reason == "stop"
    _idle(llm)


# ---- forced tokens ----
def test_forced_tokens_at_the_limits(llm, llama_path, prompts):
    want = llm.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=60, structured_outputs=LONG),
                        use_tqdm=False)[0].outputs[0]
    assert llm.get_metrics()["num_forced_tokens"] > 0
    for k in range(1, 6):  # a forced run cut by max_tokens
        got = llm.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=k, structured_outputs=LONG,
                                                        logprobs=2), use_tqdm=False)[0].outputs[0]
        assert got.token_ids == want.token_ids[:k] and got.finish_reason == "length"
        assert len(got.logprobs) == k and all(t in lp for t, lp in zip(got.token_ids, got.logprobs))
    _idle(llm)
    # a forced run cut by max_model_len
    prompt_ids = llm.engine.tokenizer.encode(prompts[1])
    short = LLM(model=llama_path, dtype="float32", device="cpu", max_model_len=len(prompt_ids) + 3)
    got = short.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=60, structured_outputs=LONG),
                         use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids[:3] and got.finish_reason == "length"
    _idle(short)
    # a forced run longer than the step's token budget is fed in chunks
    chunked = LLM(model=llama_path, **ENGINE, max_num_batched_tokens=3)
    got = chunked.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=60, structured_outputs=LONG),
                           use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids
    _idle(chunked)


@pytest.fixture(scope="module")
def eagle_head(llama_path, tmp_path_factory) -> str:
    from specdec.models.eagle import init_head, save_head
    from specdec.models.loader import load_model

    head = init_head(load_model(llama_path, torch.float32, torch.device("cpu")), seed=1)
    out = tmp_path_factory.mktemp("so_edge_eagle") / "head"
    save_head(head, out)
    return str(out)


@pytest.mark.parametrize("spec", [
    {"method": "draft_model", "model": "noisy", "num_speculative_tokens": 3},
    {"method": "eagle", "model": "eagle", "num_speculative_tokens": 3},
    {"method": "eagle", "model": "eagle", "num_speculative_tokens": 3, "tree_topk": 2, "tree_nodes": 5},
], ids=["draft-chain", "eagle-chain", "eagle-tree"])
def test_forced_tokens_with_speculation(llama_path, noisy_draft_path, eagle_head, prompts, spec):
    # every step that appends forced tokens is followed by one that feeds them with no drafts:
    # EAGLE's features and the draft KV must catch up on them; a third of the batch does not speculate
    spec = dict(spec, model={"noisy": noisy_draft_path, "eagle": eagle_head}[spec["model"]])
    plain = LLM(model=llama_path, **ENGINE)
    llm = LLM(model=llama_path, **ENGINE, speculative_config=spec)
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=LONG, use_speculation=i % 3 != 2,
                             logprobs=1 if i % 3 == 0 else None) for i in range(6)]
    want = plain.generate(prompts[:6], params, use_tqdm=False)
    got = llm.generate(prompts[:6], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    m = llm.get_metrics()
    assert m["num_forced_tokens"] > 0 and m["num_draft_tokens"] > 0
    _idle(llm)


def test_abort_mid_generation_drops_the_grammar(llm, prompts):
    engine = llm.engine
    engine.add_request("a", engine.tokenizer.encode(prompts[0]),
                       SamplingParams(temperature=0, max_tokens=60, structured_outputs=LONG))
    engine.add_request("b", engine.tokenizer.encode(prompts[1]),
                       SamplingParams(temperature=0, max_tokens=60, n=2, structured_outputs=LONG))
    for _ in range(3):
        engine.step()
    states = engine.executor.driver_worker.requests
    assert {"a", "b#0", "b#1"} <= set(states)
    assert states["b#0"].grammar is not states["b#1"].grammar
    engine.abort_request("a")
    assert "a" not in states
    while engine.has_unfinished_requests():
        engine.step()
    _idle(llm)


# ---- pruning ----
class _PrefixGrammar:
    """A stand-in grammar: accepts exactly the prefixes of ``allowed`` paths."""

    def __init__(self, allowed: list[list[int]]):
        self.allowed = allowed

    def path_cursors(self, paths: list[list[int]]):
        return [GrammarCursor(None, 0, [], self._accepted(path)) for path in paths]

    def _accepted(self, path: list[int]) -> int:
        return max(next((n for n in range(len(path) + 1) if a[:n] != path[:n]), len(path) + 1) - 1
                   for a in self.allowed) if path else 0


class _Req:
    def __init__(self, grammar):
        self.grammar = grammar


def test_prune_trees_and_chains():
    # tree: 0:a 1:b (children of the root), 2:c under a, 3:d under b, 4:e under c
    tokens, parents = [10, 11, 12, 13, 14], [-1, -1, 0, 1, 2]
    reqs = [_Req(_PrefixGrammar([[10, 12]])), _Req(None), _Req(_PrefixGrammar([[99]]))]
    prop = DraftProposal([tokens, [5, 6], [10, 11]], None, [parents, [-1, 0], [-1, -1]])
    out = prune_drafts(reqs, prop)
    assert out.draft_token_ids == [[10, 12], [5, 6], []]
    assert out.draft_parents == [[-1, 0], [-1, 0], []]
    assert out.row_histories(2) == [[]] and out.row_histories(0) == [[], [10], [10, 12]]
    # chains with q: the kept rows of q follow their drafts; a chain pruned to nothing keeps no row
    q = torch.arange(8, dtype=torch.float32).unsqueeze(1).expand(8, 4).contiguous()
    reqs = [_Req(_PrefixGrammar([[1, 2]])), _Req(None), _Req(_PrefixGrammar([[7]]))]
    prop = DraftProposal([[1, 2, 3], [4, 5, 6], [8, 9]], q)
    out = prune_drafts(reqs, prop)
    assert out.draft_token_ids == [[1, 2], [4, 5, 6], []]
    assert out.draft_probs[:, 0].tolist() == [0, 1, 3, 4, 5]


# ---- bit math and mask kernels ----
class _FakeMatcher:
    def __init__(self, words: list[int], terminated: bool = False):
        self.words = words
        self.terminated = terminated

    def is_terminated(self) -> bool:
        return self.terminated

    def fill_next_token_bitmask(self, bitmask, row):
        bitmask[row] = torch.tensor(self.words, dtype=torch.int32)


def _state(words, vocab, eos=(1,), terminated=False) -> GrammarState:
    s = GrammarState.__new__(GrammarState)
    s.matcher, s.vocab_size = _FakeMatcher(words, terminated), vocab
    s.eos_token_ids = [t for t in eos if t < vocab]
    return s


def test_forced_token_bits_and_terminated_fill():
    scratch = GrammarState.allocate(1, 96)
    assert _state([0, _bit(31), 0], 96).forced_token(scratch) == 63
    assert _state([0, 0, _bit(0)], 96).forced_token(scratch) == 64
    assert _state([0, _bit(31) | 1, 0], 96).forced_token(scratch) is None
    assert _state([_bit(3), _bit(3), 0], 96).forced_token(scratch) is None
    assert _state([0, 0, _bit(31)], 90).forced_token(scratch) is None  # past the vocabulary
    s = _state([0, 0, 0], 96, eos=(31, 63, 95, 200), terminated=True)
    bm = GrammarState.allocate(2, 96)
    GrammarCursor(s.matcher, 96, s.eos_token_ids).fill(bm, 1)
    assert unpack_row(bm[1], 96).nonzero().flatten().tolist() == [31, 63, 95]
    assert s.forced_token(scratch) is None


def test_dead_end_rows_get_eos():
    from specdec.structured_output.grammar_state import end_dead_ends

    bm = GrammarState.allocate(8, 96)
    bm[[1, 4, 6]] = 0
    rows = [0, 1, 4, 5, 6]  # two runs; row 2 (all allowed) and row 3 (not listed) stay
    bm[3] = 0
    end_dead_ends(bm, rows, [GrammarCursor(_FakeMatcher([0, 0, 0]), 96, [5, 63]) for _ in rows])
    for r in (1, 4, 6):
        assert unpack_row(bm[r], 96).nonzero().flatten().tolist() == [5, 63]
    assert bm[3].eq(0).all() and bm[[0, 2, 5]].eq(-1).all()


def _reference(logits, bitmask, rows):
    out = logits.clone()
    for r in rows:
        out[r][~unpack_row(bitmask[r], logits.shape[1])] = float("-inf")
    return out


def test_apply_bitmask_rows_views_and_inference_tensors():
    gen = torch.Generator().manual_seed(0)
    vocab = 70
    bitmask = torch.randint(-(1 << 31), (1 << 31) - 1, (6, 3), dtype=torch.int32, generator=gen)
    with torch.inference_mode():
        base = torch.randn(6, vocab + 5, generator=gen)
    rows = [4, 1, 3]
    for argmax_only in (None, [True, False, True], [True, True, True]):
        with torch.inference_mode():
            padded = base.clone()
        logits = padded[:, :vocab]  # a non-contiguous view of an inference tensor
        apply_bitmask(logits, bitmask, rows, fallback_uniform=True, argmax_only=argmax_only)
        want = _reference(base[:, :vocab], bitmask, rows)
        for j, r in enumerate(rows):
            if argmax_only and argmax_only[j]:
                assert int(logits[r].argmax()) == int(want[r].argmax())
            else:
                assert torch.equal(logits[r], want[r])
        untouched = [r for r in range(6) if r not in rows]
        assert torch.equal(logits[untouched], base[untouched, :vocab])
        assert torch.equal(padded[:, vocab:], base[:, vocab:])
    # a row with no allowed finite logit becomes uniform over its allowed tokens
    logits = torch.full((2, vocab), float("-inf"))
    apply_bitmask(logits, bitmask, [1], fallback_uniform=True)
    assert torch.equal(logits[1] == 0, unpack_row(bitmask[1], vocab))


# ---- the compile cache ----
def test_compile_cache_and_threads(llm, prompts):
    schema = {"type": "object", "properties": {"k": {"type": "string", "maxLength": 5}}, "required": ["k"]}
    first = llm.engine.compile_grammar(StructuredOutputsParams(json=schema))
    assert llm.engine.compile_grammar(StructuredOutputsParams(json=dict(schema))) is first
    errors = []

    def compile_many(i):
        try:
            for j in range(5):
                llm.engine.compile_grammar(StructuredOutputsParams(regex=f"x{i}[a-z]{{{j + 1}}}"))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=compile_many, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    outs = llm.generate(prompts[:3], SamplingParams(temperature=0, max_tokens=20, structured_outputs=CHOICE),
                        use_tqdm=False)
    for t in threads:
        t.join()
    assert not errors and all(o.outputs[0].text in CHOICE.choice for o in outs)


def test_malformed_constraints_are_value_errors(llm, prompts):
    for bad, match in [("json", "must be a StructuredOutputsParams"), ({"jsn": {}}, "unknown fields")]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(structured_outputs=bad)
    with pytest.raises(ValueError, match="looks like a Lark grammar"):
        llm.engine.compile_grammar(StructuredOutputsParams(grammar='start: "yes" | "no"'))
    # a prompt that ends inside a structure: the grammar constrains the output from its start
    out = llm.generate(['{"name": "'], SamplingParams(temperature=0, max_tokens=20, structured_outputs=CHOICE),
                       use_tqdm=False)[0].outputs[0]
    assert out.text in CHOICE.choice
    _idle(llm)


def test_preemption_after_forced_tokens(llama_path, eagle_head, prompts):
    spec = {"method": "eagle", "model": eagle_head, "num_speculative_tokens": 3}
    small = LLM(model=llama_path, dtype="float32", device="cpu", max_model_len=128, kv_cache_memory=42 * 4096,
                block_size=4, speculative_config=spec)
    plain = LLM(model=llama_path, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=LONG)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts[:10], params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in small.generate(prompts[:10], params, use_tqdm=False)]
    assert small.engine.scheduler.num_preemptions > 0 and small.get_metrics()["num_forced_tokens"] > 0
    assert got == want
    _idle(small)


def test_a_bad_grammar_in_a_batch_queues_nothing(llm, prompts):
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(("))
    good = SamplingParams(temperature=0, max_tokens=20, structured_outputs=CHOICE)
    with pytest.raises(ValueError, match=r"structured_outputs\.regex"):
        llm.generate(prompts[:3], [good, good, bad], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    outs = llm.generate(prompts[:2], good, use_tqdm=False)
    assert all(o.outputs[0].text in CHOICE.choice for o in outs)
    _idle(llm)


def test_a_grammar_the_vocabulary_cannot_continue_ends_the_request(make_model, make_char_tokenizer):
    # a character-level vocabulary without capitals: after "ab" no token continues "abX"
    path = make_model("so_char", tokenizer=make_char_tokenizer(), vocab_size=32)
    spec = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 2, "num_speculative_tokens": 3}
    for kw in ({}, {"speculative_config": spec}):
        llm = LLM(model=path, **ENGINE, **kw)
        dead = [SamplingParams(temperature=t, seed=0, max_tokens=10, structured_outputs=c)
                for t in (0.0, 1.0) for c in (StructuredOutputsParams(choice=["abX"]),
                                                 StructuredOutputsParams(regex="ab[A-Z]"))]
        outs = llm.generate(["ab ab ab"] * 4 + ["cd"], dead + [SamplingParams(max_tokens=5)], use_tqdm=False)
        for o in outs[:4]:
            assert o.outputs[0].text == "ab" and o.outputs[0].finish_reason == "stop"
        assert len(outs[4].outputs[0].token_ids) == 5
        _idle(llm)
