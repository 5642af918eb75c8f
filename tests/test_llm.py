"""The offline API (``LLM.generate`` / ``LLM.chat``) against vLLM's behaviour.

Expected values come from independent sources: a plain greedy run of the same engine
(stops must cut it at the right place), transformers (log-probabilities) and the chat
template's own text, never from the feature under test.
"""
from __future__ import annotations

import pytest
import torch

from specdec import LLM, SamplingParams

ENGINE = dict(dtype="float32", device="cpu")
MAX_TOKENS = 24


def greedy(max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=kw.pop("ignore_eos", True), **kw)


@pytest.fixture(scope="module")
def llm(llama_path) -> LLM:
    return LLM(model=llama_path, **ENGINE, max_model_len=128)


@pytest.fixture(scope="module")
def reference(llm, prompts) -> dict[str, list[int]]:
    """Unconstrained greedy continuations (ignore_eos, MAX_TOKENS tokens) of every prompt."""
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    return {p: o.outputs[0].token_ids for p, o in zip(prompts, outs)}


def assert_no_leaks(llm: LLM) -> None:
    engine = llm.engine
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
    assert not engine.has_unfinished_requests() and not engine.groups and not engine.kv.req_blocks


def first_occurrence_cases(reference, accept):
    """(prompt, ids, j) where ids[j] is a token's first occurrence, j >= 2, and accept(token) holds."""
    for prompt, ids in reference.items():
        for j in range(2, len(ids) - 2):
            if ids[j] not in ids[:j] and accept(ids[j]):
                yield prompt, ids, j


# ---- prompts the engine must refuse ----

def test_prompt_longer_than_max_model_len_is_refused_and_engine_stays_usable(llm, reference):
    too_long = list(range(3, 3 + 200))
    with pytest.raises(ValueError, match=r"200 tokens.*max_model_len is 128"):
        llm.generate([too_long], greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match=r"128 tokens.*max_model_len is 128"):  # == limit: no room to generate
        llm.generate(["def f(x):", list(range(3, 131))], greedy(), use_tqdm=False)
    assert_no_leaks(llm)  # the valid prompt of that batch was not queued either
    out = llm.generate(["def f(x):"], greedy(), use_tqdm=False)
    assert out[0].outputs[0].token_ids == reference["def f(x):"]
    assert_no_leaks(llm)


def test_bad_prompts_name_the_problem(llm):
    with pytest.raises(ValueError, match="at least one token"):
        llm.generate([[]], greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match=r"token id 100000 is outside the vocabulary \[0, 320\)"):
        llm.generate([[5, 100000]], greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
        llm.generate(["a"], [greedy(), greedy()], use_tqdm=False)
    assert_no_leaks(llm)


def test_unknown_engine_argument_is_named(llama_path):
    with pytest.raises(ValueError, match="max_num_seq"):
        LLM(model=llama_path, **ENGINE, max_num_seq=4)


@pytest.mark.parametrize("field, value", [
    ("max_num_seqs", 0), ("max_num_batched_tokens", -1), ("block_size", 0), ("max_model_len", 0),
    ("kv_cache_memory", 0), ("gpu_memory_utilization", 1.5), ("quantization", "int3"),
    ("attention_backend", "flash"), ("dtype", "float64"), ("device", "tpu"),
])
def test_bad_engine_argument_values_are_named(llama_path, field, value):
    with pytest.raises(ValueError, match=field):
        LLM(model=llama_path, **{**ENGINE, field: value})


def test_max_model_len_beyond_the_model_is_refused(llama_path):
    with pytest.raises(ValueError, match=r"max_model_len 4096 exceeds the model's limit of 1024"):
        LLM(model=llama_path, **ENGINE, max_model_len=4096)


# ---- stopping ----

def test_max_tokens_is_exact(llm, reference):
    prompt = "import json"
    for max_tokens in (1, 2, 7):
        (out,) = llm.generate([prompt], greedy(max_tokens), use_tqdm=False)
        assert out.outputs[0].token_ids == reference[prompt][:max_tokens]
        assert out.outputs[0].finish_reason == "length" and out.finished


def test_context_limit_ends_generation(llama_path):
    llm = LLM(model=llama_path, **ENGINE, max_model_len=32)
    outs = llm.generate([list(range(3, 34)), list(range(3, 23))], greedy(max_tokens=None), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 12]  # prompt + output == max_model_len
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert_no_leaks(llm)


def test_stop_token_ids_cut_there_and_leave_the_token_out_of_the_text(llm, reference):
    tok = llm.tokenizer
    prompt, ids, j = next(first_occurrence_cases(reference, lambda t: tok.decode([t]) != ""))
    stop_id = ids[j]
    (out,) = llm.generate([prompt], greedy(stop_token_ids=[stop_id]), use_tqdm=False)
    c = out.outputs[0]
    assert c.token_ids == ids[: j + 1]  # the stop token is in token_ids (vLLM)
    assert (c.finish_reason, c.stop_reason) == ("stop", stop_id)
    assert c.text == tok.decode(ids[:j])  # ... but not in the text
    (out,) = llm.generate([prompt], greedy(stop_token_ids=[stop_id], include_stop_str_in_output=True), use_tqdm=False)
    assert out.outputs[0].text == tok.decode(ids[: j + 1])


def stop_string_case(tok, reference):
    """A clean ASCII token whose text first appears at token j of a greedy continuation."""
    def clean(t):
        piece = tok.decode([t])
        return piece.strip() != "" and piece.isascii() and piece.isprintable()

    for prompt, ids, j in first_occurrence_cases(reference, clean):
        piece, before, upto = tok.decode([ids[j]]), tok.decode(ids[:j]), tok.decode(ids[: j + 1])
        if upto == before + piece and upto.find(piece) == len(before):
            return prompt, ids, j, piece
    pytest.fail("no greedy continuation contains a clean ASCII token to use as a stop string")


def test_stop_string_is_cut_from_the_text(llm, reference):
    tok = llm.tokenizer
    prompt, ids, j, stop = stop_string_case(tok, reference)
    (out,) = llm.generate([prompt], greedy(stop=["\x00never", stop]), use_tqdm=False)
    c = out.outputs[0]
    assert c.token_ids == ids[: j + 1]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    assert c.text == tok.decode(ids[:j]) and stop not in c.text
    (out,) = llm.generate([prompt], greedy(stop=[stop], include_stop_str_in_output=True), use_tqdm=False)
    assert out.outputs[0].text == tok.decode(ids[: j + 1]) and out.outputs[0].text.endswith(stop)


def test_stop_string_made_before_min_tokens_does_not_stop_later(llm, reference):
    tok = llm.tokenizer
    prompt, ids, j, stop = stop_string_case(tok, reference)
    (out,) = llm.generate([prompt], greedy(stop=[stop], min_tokens=j + 1), use_tqdm=False)
    c = out.outputs[0]
    assert len(c.token_ids) > j + 1 and c.token_ids == ids[: len(c.token_ids)]
    assert c.text.startswith(tok.decode(ids[: j + 1]))  # the early occurrence is kept, as in vLLM
    if c.finish_reason == "stop":  # a later occurrence may still stop it
        assert c.text.find(stop) == len(tok.decode(ids[:j])) and not c.text.endswith(stop)


@pytest.fixture(scope="module")
def eos_case(llm, reference, llama_path, make_copy_with_eos, tmp_path_factory):
    """The same weights with one greedy token declared EOS in generation_config.json."""
    prompt, ids, j = next(first_occurrence_cases(reference, lambda t: llm.tokenizer.decode([t]) != ""))
    path = make_copy_with_eos(llama_path, tmp_path_factory.mktemp("eos_model"), ids[j])
    return LLM(model=path, **ENGINE, max_model_len=128), prompt, ids, j


def test_eos_stops_and_is_left_out_of_the_text(eos_case):
    eos_llm, prompt, ids, j = eos_case
    assert ids[j] in eos_llm.engine.eos_token_ids
    (out,) = eos_llm.generate([prompt], greedy(ignore_eos=False), use_tqdm=False)
    c = out.outputs[0]
    assert c.token_ids == ids[: j + 1]
    assert (c.finish_reason, c.stop_reason) == ("stop", None)
    assert c.text == eos_llm.tokenizer.decode(ids[:j])
    (out,) = eos_llm.generate([prompt], greedy(ignore_eos=True), use_tqdm=False)
    assert out.outputs[0].token_ids == ids and out.outputs[0].finish_reason == "length"



def test_min_tokens_holds_back_eos_and_stop_token_ids(eos_case):
    eos_llm, prompt, ids, j = eos_case
    eos = ids[j]
    for params in (greedy(ignore_eos=False, min_tokens=j + 3),
                   greedy(ignore_eos=True, min_tokens=j + 3, stop_token_ids=[eos])):
        (out,) = eos_llm.generate([prompt], params, use_tqdm=False)
        c = out.outputs[0]
        assert len(c.token_ids) >= j + 3
        assert eos not in c.token_ids[: j + 3]  # banned from the logits, not merely ignored
        assert c.token_ids[:j] == ids[:j]
        assert c.finish_reason == "length" or c.token_ids[-1] == eos


# ---- sampling ----

def test_n_completions(llm, reference):
    (out,) = llm.generate(["def f(x):"], greedy(n=3), use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.token_ids == reference["def f(x):"] for c in out.outputs)
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    (a,) = llm.generate(["def f(x):"], params, use_tqdm=False)
    (b,) = llm.generate(["def f(x):"], params, use_tqdm=False)
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]  # seeded: reproducible
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1  # but the n samples differ
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in a.outputs)
    assert a.metrics.num_generated_tokens == 48
    assert_no_leaks(llm)


def test_seeded_request_is_independent_of_the_batch(llm, prompts):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    (alone,) = llm.generate(["class Decoder(object):"], seeded, use_tqdm=False)
    others = [SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=20),
              SamplingParams(temperature=0.7, top_k=5, seed=1, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=1.2, min_p=0.1, n=2, max_tokens=5, ignore_eos=True)]
    batch_prompts = prompts[:4] + ["class Decoder(object):"] + prompts[4:8]
    batch_params = others + [seeded] + others
    outs = llm.generate(batch_prompts, batch_params, use_tqdm=False)
    assert outs[4].outputs[0].token_ids == alone.outputs[0].token_ids


def test_logprobs_match_transformers(llm, llama_path, reference):
    from transformers import AutoModelForCausalLM

    prompt = "for i in range(10):"
    (out,) = llm.generate([prompt], greedy(logprobs=2), use_tqdm=False)
    c = out.outputs[0]
    prompt_ids = llm.tokenizer.encode(prompt)
    model = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + c.token_ids])).logits[0]
    ref = torch.log_softmax(logits[len(prompt_ids) - 1: -1], dim=-1)  # [num_generated, V]
    assert len(c.logprobs) == len(c.token_ids) == MAX_TOKENS
    for pos, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        top2 = ref[pos].topk(2).indices.tolist()
        assert token == top2[0] and set(top2) <= set(entry) and len(entry) <= 3
        for t, lp in entry.items():
            assert lp == pytest.approx(ref[pos, t].item(), abs=1e-4)
    assert c.cumulative_logprob == pytest.approx(sum(e[t] for e, t in zip(c.logprobs, c.token_ids)))
    (out,) = llm.generate([prompt], greedy(), use_tqdm=False)
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None


def test_penalties_match_an_independent_reference(llm, llama_path):
    """vLLM semantics, recomputed here from transformers logits: repetition penalty divides
    positive / multiplies negative logits of every token seen in prompt or output; frequency
    and presence penalties subtract count * f and (count > 0) * p for output tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32)
    prompt_ids = llm.tokenizer.encode("for i in range(10):")
    rep, freq, pres = 1.3, 0.4, 0.6
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(12):
            logits = model(torch.tensor([ids])).logits[0, -1]
            out = ids[len(prompt_ids):]
            seen = torch.zeros_like(logits, dtype=torch.bool)
            seen[ids] = True
            logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.numel()).float()
            logits = logits - freq * counts - pres * (counts > 0).float()
            ids.append(int(logits.argmax()))
    params = greedy(12, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)
    (res,) = llm.generate([prompt_ids], params, use_tqdm=False)
    assert res.outputs[0].token_ids == ids[len(prompt_ids):]


# ---- chat ----

def test_chat_goes_through_the_template(llm):
    messages = [{"role": "user", "content": "hi there"}]
    (out,) = llm.chat(messages, greedy(8), use_tqdm=False)
    assert llm.tokenizer.decode(out.prompt_token_ids) == "<|bos|>user: hi there\n<|bos|>assistant: "
    assert len(out.outputs[0].token_ids) == 8
    convs = [messages, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x"}]]
    outs = llm.chat(convs, greedy(4), use_tqdm=False)
    assert llm.tokenizer.decode(outs[1].prompt_token_ids) == "<|bos|>system: be brief\n<|bos|>user: x\n<|bos|>assistant: "
    assert outs[0].outputs[0].token_ids == out.outputs[0].token_ids[:4]


# ---- the engine API underneath ----

def test_abort_mid_generation_frees_everything(llm):
    engine = llm.engine
    engine.add_request("keep", llm.tokenizer.encode("import json"), greedy(6))
    engine.add_request("drop", llm.tokenizer.encode("def f(x):"), SamplingParams(n=2, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort_request(["drop", "never-added"])
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert list(finished) == ["keep"] and len(finished["keep"].outputs[0].token_ids) == 6
    assert_no_leaks(llm)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", [5], greedy(2))
        engine.add_request("x", [5], greedy(2))
    engine.abort_request("x")
    assert_no_leaks(llm)


def test_streamed_text_never_shrinks_with_stop_strings(llm, reference):
    """Running outputs hold back a possible partial stop string (vLLM's stop buffer), so every
    intermediate text is a prefix of the final one."""
    tok = llm.tokenizer
    prompt, ids, j, stop = stop_string_case(tok, reference)
    stop = stop + "\x01never"  # a long stop string that never completes: only its prefix appears
    engine = llm.engine
    engine.add_request("stream", tok.encode(prompt), greedy(stop=[stop, tok.decode(ids[j:j + 2])]))
    texts = []
    while engine.has_unfinished_requests():
        texts += [o.outputs[0].text for o in engine.step()]
    assert len(texts) > 3
    assert all(texts[-1].startswith(t) for t in texts), texts
    assert_no_leaks(llm)


def test_final_outputs_only_reports_each_request_once_when_it_ends(llm, reference):
    """LLM.generate's mode (vLLM's FINAL_ONLY): running requests are not re-decoded every step; each
    request is reported once, finished, with the text and tokens a streaming run gives."""
    engine = llm.engine
    n_short = MAX_TOKENS // 2
    engine.add_request("short", llm.tokenizer.encode("def f(x):"), greedy(n_short))
    engine.add_request("pair", llm.tokenizer.encode("import json"), greedy(n=2))
    engine.final_outputs_only = True
    try:
        seen = []
        while engine.has_unfinished_requests():
            seen += engine.step()
    finally:
        engine.final_outputs_only = False
    assert [o.request_id for o in seen] == ["short", "pair"] and all(o.finished for o in seen)
    assert seen[0].outputs[0].token_ids == reference["def f(x):"][:n_short]
    assert seen[0].outputs[0].text == llm.tokenizer.decode(reference["def f(x):"][:n_short])
    assert all(c.token_ids == reference["import json"] for c in seen[1].outputs)
    assert_no_leaks(llm)
