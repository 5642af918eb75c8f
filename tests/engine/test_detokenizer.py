"""Incremental detokenisation (``OutputProcessor.update_text``) against a full decode.

For byte-level BPE (the tiny tokenizer: byte tokens, so random ids form incomplete and invalid
UTF-8), a SentencePiece-style Metaspace decoder (a word's leading space depends on whether it
starts the text) and a character tokenizer with specials, the text built piece by piece, one or
several tokens at a time, must equal ``tokenizer.decode`` of all tokens whenever that does not
end in an incomplete character, and must never shrink. 60 random sequences per tokenizer.
"""
from __future__ import annotations

import random

import pytest

from specdec.engine.output_processor import OutputProcessor
from specdec.engine.request import Request
from specdec.sampling_params import SamplingParams


def metaspace_tokenizer():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    words = ["<s>", "</s>", "<unk>", "\u2581the", "\u2581cat", "\u2581sat", "s", "\u2581on", "\u2581mat", ".",
             "\u2581", "ing", "\u2581caf", "\u00e9", "\u2581na\u00efve"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _check(tokenizer, vocab_size: int, skip_special_tokens: bool, seed: int):
    rng = random.Random(seed)
    proc = OutputProcessor(tokenizer, max_model_len=1 << 20)
    for trial in range(60):
        req = Request(f"r{trial}", [0], SamplingParams(max_tokens=1000, skip_special_tokens=skip_special_tokens))
        previous = ""
        for _ in range(rng.randrange(1, 40)):
            for _ in range(rng.choice([1, 1, 1, 2, 5])):  # several tokens between updates (accepted drafts)
                req.append_output_token(rng.randrange(vocab_size))
            text = proc.update_text(req)
            assert text.startswith(previous)  # streamed text only grows
            previous = text
            full = proc.decode(req)
            if not full.endswith("\ufffd"):
                assert text == full, (req.output_token_ids, text, full)


def test_incremental_text_matches_full_decode_byte_level(tiny_tokenizer):
    _check(tiny_tokenizer, len(tiny_tokenizer), skip_special_tokens=True, seed=0)


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_text_matches_full_decode_metaspace(skip):
    tok = metaspace_tokenizer()
    _check(tok, len(tok), skip_special_tokens=skip, seed=1)


def test_incremental_text_matches_full_decode_with_specials(make_char_tokenizer):
    tok = make_char_tokenizer()
    _check(tok, len(tok), skip_special_tokens=True, seed=2)


def _run_until_stop(proc: OutputProcessor, tokenizer, text: str, stops: list[str], per_step: int = 1, **kw):
    """Feed ``text`` (character tokens) ``per_step`` tokens at a time until a stop string ends it."""
    params = SamplingParams(max_tokens=1000, stop=stops, **kw)
    req = Request("r", [0], params)
    ids = tokenizer.encode(text, add_special_tokens=False)
    for i, tid in enumerate(ids):
        if proc.append_token(req, tid) is not None:
            return req, i + 1
    return req, None


def test_stop_strings_cut_at_the_earliest_match_whatever_their_order(make_char_tokenizer):
    tok = make_char_tokenizer()
    proc = OutputProcessor(tok, max_model_len=1 << 20)
    for stops in (["b", "ab"], ["ab", "b"]):
        req, num_tokens = _run_until_stop(proc, tok, "xaby", stops)
        # "b" completes first (token 3), and the earliest stop ending there is "ab", starting at 1
        assert (req.output_text, req.stop_reason, num_tokens) == ("x", "ab", 3)
    req, _ = _run_until_stop(proc, tok, "xaby", ["b", "ab"], include_stop_str_in_output=True)
    assert req.output_text == "xab"
    req, num_tokens = _run_until_stop(proc, tok, "the cat sat on", ["t sat", "cat sat", "zz"])
    assert (req.output_text, req.stop_reason, num_tokens) == ("the ", "cat sat", 11)  # both end at token 11


def test_stop_strings_match_a_brute_force_search_on_random_text(make_char_tokenizer):
    """Random text over 3 letters and 1-4 random stops of 1-4 letters: the text is cut at the
    first token after which some stop occurs, before the earliest occurrence; 300 cases."""
    tok = make_char_tokenizer()
    proc = OutputProcessor(tok, max_model_len=1 << 20)
    rng = random.Random(3)
    for _ in range(300):
        text = "".join(rng.choice("abc") for _ in range(rng.randrange(1, 40)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randrange(1, 5))) for _ in range(rng.randrange(1, 5))]
        req, num_tokens = _run_until_stop(proc, tok, text, stops)
        first_end = min((text.find(s) + len(s) for s in stops if s in text), default=None)
        assert num_tokens == first_end
        if first_end is None:
            assert req.output_text == text
            continue
        prefix = text[:first_end]
        cut = min(prefix.find(s) for s in stops if s in prefix)
        assert req.output_text == text[:cut] and not any(s in req.output_text for s in stops)
