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
