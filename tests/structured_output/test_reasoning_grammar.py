"""A grammar that starts where the reasoning ends (ReasoningGrammarState): every token is
allowed while reasoning, the inner grammar's tokens once the end-of-thinking tokens have been
generated, and the masks depend on the tokens alone (trial paths and commits agree), so
greedy speculative decoding equals plain decoding across the switch, chains and trees."""
from __future__ import annotations

import json
import random

import pytest
import torch
import xgrammar as xgr

from specdec import LLM, SamplingParams
from specdec.structured_output import StructuredOutputsParams
from specdec.structured_output.grammar_state import GrammarState
from specdec.structured_output.masking import unpack_row
from specdec.structured_output.reasoning_grammar import ReasoningGatedParams, ReasoningGrammarState, gated_state

VOCAB = [chr(i) for i in range(32, 127)] + ["<think>", "</think>", "<eos>"]
THINK, END, EOS = len(VOCAB) - 3, len(VOCAB) - 2, len(VOCAB) - 1
DIGITS = {VOCAB.index(c) for c in "0123456789"}


@pytest.fixture(scope="module")
def compiled():
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(VOCAB, stop_token_ids=[EOS]))
    return compiler.compile_regex("[0-9]{2}")


def allowed(state, path=None) -> set[int]:
    """Tokens allowed after the committed output plus ``path`` (a cursor forked for it), or at a cursor."""
    bitmask = GrammarState.allocate(1, len(VOCAB))
    cursor = state if hasattr(state, "advance") else state.path_cursors([path or []])[0]
    cursor.fill(bitmask, 0)
    return set(unpack_row(bitmask[0], len(VOCAB)).nonzero().flatten().tolist())


def walk(state, path) -> int:
    """How many tokens of ``path`` a trial cursor accepts."""
    return state.path_cursors([path])[0].num_accepted


def ids(text: str) -> list[int]:
    return [VOCAB.index(c) for c in text]


def make(compiled, end=(END,), start=None) -> ReasoningGrammarState:
    return ReasoningGrammarState(GrammarState(compiled, len(VOCAB), (EOS,)), end, start)


def test_everything_is_allowed_until_the_reasoning_ends_then_the_grammar(compiled):
    state = make(compiled)
    assert allowed(state) == set(range(len(VOCAB)))
    assert state.commit(ids("ab x")) == 4 and allowed(state) == set(range(len(VOCAB)))
    assert state.forced_token(GrammarState.allocate(1, len(VOCAB))) is None
    assert state.commit([END]) == 1
    assert allowed(state) == DIGITS
    assert state.commit(ids("4a")) == 1  # the grammar refuses the letter
    assert state.commit(ids("2")) == 1 and allowed(state) == {EOS}


def test_a_multi_token_end_sequence_may_span_commits_and_paths(compiled):
    state = make(compiled, end=tuple(ids("##!")))
    state.commit(ids("x#"))
    assert allowed(state, ids("#")) == set(range(len(VOCAB)))
    assert allowed(state, ids("#!")) == DIGITS
    assert allowed(state, ids("!")) == set(range(len(VOCAB)))  # "x#!" is not the sequence
    state.commit(ids("#!"))
    assert allowed(state) == DIGITS


def test_an_optional_reasoning_is_opened_by_the_first_token(compiled):
    state = make(compiled, start=THINK)
    assert allowed(state) == DIGITS | {THINK}
    assert allowed(state, [THINK]) == set(range(len(VOCAB)))
    assert allowed(state, ids("1")) == DIGITS
    assert walk(state, ids("1a")) == 1  # answering at once: the grammar from the first token
    assert walk(state, [THINK, *ids("hm"), END, *ids("12")]) == 6
    assert allowed(state, [THINK, END, *ids("12")]) == {EOS}


def test_masks_after_a_path_equal_masks_after_committing_it(compiled):
    """The property speculation relies on: a trial path (forked cursors, any number of other
    paths walked first) gives the mask a request that committed those tokens would have; and a
    cursor forked midway agrees with one walked whole."""
    rng = random.Random(0)
    alphabet = [*ids("ab1#"), END, THINK]
    for trial in range(300):
        start = THINK if trial % 2 else None
        seq = [rng.choice(alphabet) for _ in range(rng.randint(0, 8))]
        cut = rng.randint(0, len(seq))
        speculative = make(compiled, start=start)
        speculative.commit(seq[:cut])
        for _ in range(3):  # wander: other paths first
            speculative.path_cursors([[rng.choice(alphabet) for _ in range(rng.randint(0, 4))]])
        cursor = speculative.path_cursors([seq[cut:]])[0]
        accepted = cursor.num_accepted
        forked = speculative.cursor()
        for t in seq[cut:cut + accepted // 2]:
            forked.advance(t)
        forked = forked.fork()
        for t in seq[cut + accepted // 2:cut + accepted]:
            assert forked.advance(t)
        plain = make(compiled, start=start)
        n = plain.commit(seq[:cut]) + plain.commit(seq[cut:cut + accepted])
        if n == cut + accepted:
            assert allowed(cursor) == allowed(plain) == allowed(forked), (seq, cut)


def test_plain_params_give_the_plain_state(compiled):
    inner = GrammarState(compiled, len(VOCAB), (EOS,))
    params = StructuredOutputsParams(regex="[0-9]{2}")
    assert gated_state(params, inner) is inner
    gated = ReasoningGatedParams.wrap(params, [END])
    assert isinstance(gated_state(gated, inner), ReasoningGrammarState)
    assert gated.cache_key == params.cache_key and gated.regex == params.regex
    with pytest.raises(ValueError, match="reasoning_end_token_ids"):
        ReasoningGatedParams.wrap(params, [])


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}}, "required": ["n", "ok"],
          "additionalProperties": False}
ENGINE = dict(dtype="float32", device="cpu", max_model_len=256)


@pytest.fixture(scope="module")
def thinking(thinking_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(thinking_model_path)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
               for p in ("def f(x):", "import json", "Hello")]
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
    params = ReasoningGatedParams.wrap(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
                                       [tok.convert_tokens_to_ids("</think>")])
    sampling = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=params)
    plain = LLM(model=thinking_model_path, **ENGINE).generate(
        [{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
    return tok, prompts, sampling, [o.outputs[0] for o in plain]


def test_the_answer_after_the_reasoning_is_in_the_grammar(thinking):
    tok, _, _, plain = thinking
    first = plain[0]
    reasoning, sep, answer = first.text.partition("</think>")
    assert sep and reasoning.strip()  # it thought, then closed the reasoning
    assert json.loads(answer)["n"] in range(100) and first.finish_reason == "stop"


@pytest.mark.parametrize("spec", [
    {"method": "draft_model", "num_speculative_tokens": 4},
    {"method": "draft_model", "num_speculative_tokens": 3, "tree_topk": 2, "tree_nodes": 6},
    {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3, "num_speculative_tokens": 4},
], ids=["draft-chain", "draft-tree", "ngram"])
def test_greedy_speculative_equals_plain_across_the_switch(thinking, thinking_model_path, make_perturbed_copy,
                                                           tmp_path_factory, spec):
    _, prompts, sampling, plain = thinking
    if spec["method"] == "draft_model":
        spec = {**spec, "model": make_perturbed_copy(thinking_model_path, tmp_path_factory.mktemp("draft"),
                                                     scale=0.1, seed=3)}
    llm = LLM(model=thinking_model_path, **ENGINE, speculative_config=spec)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [p.token_ids for p in plain]
    metrics = llm.get_metrics()
    assert metrics["num_draft_tokens"] > 0 and metrics["num_accepted_tokens"] > 0, metrics
