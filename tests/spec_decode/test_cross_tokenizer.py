"""Draft models with another tokenizer than the target (``spec_decode/cross_tokenizer.py``).

Targets and drafts here have different vocabularies that partly overlap: a byte-level BPE
trained on other text with its special tokens in another order, the target's own tokenizer with
its ids permuted (and the weights permuted with them: a draft that predicts the target exactly
where both tokenize alike), and for the statistical test a SentencePiece-style BPE (Metaspace,
merges such as "▁the") over the target's character vocabulary.
"""
from __future__ import annotations

import inspect
import json
import shutil
import string
from pathlib import Path

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.structured_output import StructuredOutputsParams

ENGINE = dict(dtype="float32", device="cpu", max_model_len=256, max_num_seqs=16)
MIXED = ["def f(x):", "import json", "class Decoder(object):", "    return value", "héllo wörld → ünïcode ✓",
         "a", "try:\n    import json\nexcept ImportError:", "s = json.dumps(obj, indent=4)"]


def _bpe_tokenizer(texts: list[str], vocab_size: int, specials: list[str], metaspace: bool = False, alphabet=None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    if metaspace:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
        tok.decoder = decoders.Metaspace(prepend_scheme="never")
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=alphabet or pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    names = dict(zip(("bos_token", "eos_token", "pad_token"), sorted(specials, key=lambda s: ("bos" not in s,
                                                                                               "eos" not in s))))
    return PreTrainedTokenizerFast(tokenizer_object=tok, **names)


@pytest.fixture(scope="module")
def other_bpe_draft(make_model) -> str:
    """A one-layer random draft whose byte-level BPE was trained on other sources."""
    import collections

    tok = _bpe_tokenizer([inspect.getsource(string), inspect.getsource(collections)], 400,
                         ["<|eos|>", "<|pad|>", "<|bos|>"])
    return make_model("xtok_other_bpe", arch="llama", tokenizer=tok, vocab_size=400, num_layers=1, seed=2)


@pytest.fixture(scope="module")
def permuted_draft(llama_path, tmp_path_factory) -> str:
    """The target with every non-special token id reversed in its tokenizer and weights."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("xtok_permuted")
    shutil.copytree(llama_path, out, dirs_exist_ok=True)
    tok_file = out / "tokenizer.json"
    data = json.loads(tok_file.read_text())
    vocab = data["model"]["vocab"]
    first, last = 3, max(vocab.values())  # ids 0..2 are the special tokens
    perm = {i: (first + last - i if i >= first else i) for i in range(last + 1)}
    data["model"]["vocab"] = {t: perm[i] for t, i in vocab.items()}
    tok_file.write_text(json.dumps(data))
    (out / "vocab.json").unlink(missing_ok=True)
    (out / "merges.txt").unlink(missing_ok=True)
    order = torch.arange(json.loads((out / "config.json").read_text())["vocab_size"])
    order[: last + 1] = torch.tensor([perm[i] for i in range(last + 1)])  # new row i holds old row order[i]
    for file in out.glob("*.safetensors"):
        weights = load_file(str(file))
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name in weights:
                weights[name] = weights[name][order].contiguous()
        save_file(weights, str(file), metadata={"format": "pt"})
    return str(out)


def _spec(target: str, draft: str, k=3, **kw) -> LLM:
    return LLM(model=target, **{**ENGINE, **kw},
               speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": k})


def _greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def plain_llm(llama_path) -> LLM:
    return LLM(model=llama_path, **ENGINE)


# ---- the bridge and the re-tokenized context ----
def test_bridge_pairs_tokens_with_equal_bytes(llama_path, other_bpe_draft):
    from specdec.engine.builder import load_tokenizer
    from specdec.spec_decode.vocab_bridge import VocabBridge

    target, draft = load_tokenizer(llama_path), load_tokenizer(other_bpe_draft)
    bridge = VocabBridge.build(target, draft, 320, 400)
    assert 256 < bridge.size < 320  # every byte, some merges, not all
    for t, d in zip(bridge.target_ids.tolist(), bridge.draft_ids.tolist()):
        assert target.decode([t]) == draft.decode([d])
        assert bridge.target_bytes[t] == bridge.draft_bytes[d]
    eos_t, eos_d = target.convert_tokens_to_ids("<|eos|>"), draft.convert_tokens_to_ids("<|eos|>")
    assert eos_t != eos_d and bridge.target_to_draft[eos_t] == eos_d  # specials meet by their string


def test_sentencepiece_and_byte_level_token_bytes():
    from specdec.spec_decode.vocab_bridge import token_bytes

    assert token_bytes("▁the", "sentencepiece") == b" the"
    assert token_bytes("<0x0A>", "sentencepiece") == b"\n"
    assert token_bytes("Ġworld", "byte_level") == b" world"
    assert token_bytes("Ċ", "byte_level") == b"\n"
    assert token_bytes("Ã©", "byte_level") == "é".encode()


def test_draft_context_follows_the_text_incrementally(llama_path, other_bpe_draft):
    """Fed one target token at a time (multi-byte characters split across tokens included), the
    draft's tokens equal the draft tokenizer's encoding of the whole text."""
    from specdec.engine.builder import load_tokenizer
    from specdec.spec_decode.cross_tokenizer import DraftContext
    from specdec.spec_decode.vocab_bridge import VocabBridge

    target, draft = load_tokenizer(llama_path), load_tokenizer(other_bpe_draft)
    bridge = VocabBridge.build(target, draft, 320, 400)
    for text in MIXED + ["x = 1\n" * 5 + "<|eos|>tail"]:
        ids = target.encode(text, add_special_tokens=False)
        ctx = DraftContext()
        for n in range(1, len(ids) + 1):
            ctx.sync(bridge, ids[:n])
        assert ctx.ids == draft.encode(text, add_special_tokens=False), text
    # random tokens: bytes that are no UTF-8 go to the draft as its byte tokens, so the draft's
    # tokens spell the text exactly (an incomplete trailing character waits)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        ids = torch.randint(3, 320, (12,), generator=gen).tolist()
        ctx = DraftContext()
        for n in range(1, len(ids) + 1):
            ctx.sync(bridge, ids[:n])
        text = b"".join(bridge.target_bytes[t] for t in ids)
        spelled = b"".join(bridge.draft_bytes[d] for d in ctx.ids)
        assert text.startswith(spelled) and len(text) - len(spelled) < 4 and ctx.ends is not None


# ---- greedy: identical to plain decoding ----
@pytest.mark.parametrize("draft_name", ["other_bpe_draft", "permuted_draft"])
def test_greedy_batch_is_identical_to_plain(request, llama_path, plain_llm, draft_name):
    draft = request.getfixturevalue(draft_name)
    reference = [o.outputs[0].token_ids for o in plain_llm.generate(MIXED, _greedy(), use_tqdm=False)]
    llm = _spec(llama_path, draft)
    outs = [o.outputs[0].token_ids for o in llm.generate(MIXED, _greedy(), use_tqdm=False)]
    assert outs == reference
    m = llm.get_metrics()
    assert m["num_draft_tokens"] > 100
    if draft_name == "permuted_draft":  # the same model behind another tokenizer: most drafts accepted
        assert m["acceptance_rate"] > 0.6, m


def test_auto_k_and_stop_strings(llama_path, plain_llm, permuted_draft):
    llm = LLM(model=llama_path, **ENGINE, speculative_config={"method": "draft_model", "model": permuted_draft,
                                                              "num_speculative_tokens": "auto"})
    reference = plain_llm.generate(MIXED, _greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in llm.generate(MIXED, _greedy(), use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in reference]
    cases = []
    for prompt, out in zip(MIXED, reference):
        text = out.outputs[0].text
        for i in range(len(text) // 3, len(text) - 1):  # a clean two-character stop past the first third
            if text[i:i + 2].isascii() and text[i:i + 2].isprintable() and text[i:i + 2].strip() == text[i:i + 2]:
                cases.append((prompt, text[i:i + 2]))
                break
    assert len(cases) >= 4
    for prompt, stop in cases:
        (want,) = plain_llm.generate([prompt], _greedy(stop=[stop]), use_tqdm=False)
        (got,) = llm.generate([prompt], _greedy(stop=[stop]), use_tqdm=False)
        assert (got.outputs[0].token_ids, got.outputs[0].text, got.outputs[0].finish_reason) == \
            (want.outputs[0].token_ids, want.outputs[0].text, "stop")


def test_json_schema_request(llama_path, plain_llm, other_bpe_draft):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["name", "n"]}
    params = _greedy(40, structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    llm = _spec(llama_path, other_bpe_draft)
    want = plain_llm.generate(MIXED[:4], params, use_tqdm=False)
    got = llm.generate(MIXED[:4], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert all(o.outputs[0].text.startswith('{"') for o in got)  # the grammar held
    assert llm.get_metrics()["num_draft_tokens"] > 0


def test_token_trees_are_refused(llama_path, other_bpe_draft):
    with pytest.raises(ValueError, match="another tokenizer.*token trees"):
        LLM(model=llama_path, **ENGINE, speculative_config={"method": "draft_model", "model": other_bpe_draft,
                                                            "num_speculative_tokens": 3, "tree_topk": 2})


# ---- sampling: exactly the target's distribution ----
@pytest.fixture(scope="module")
def char_target_and_sp_draft(make_model, make_char_tokenizer):
    """A 30-token character-level target and a random draft over a SentencePiece-style BPE of
    the same characters (merges like "▁the" the target lacks; specials at other ids)."""
    tok = make_char_tokenizer()
    shape = dict(arch="llama", hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64,
                 initializer_range=0.05)
    target = make_model("dist_target", num_layers=2, seed=21, vocab_size=len(tok), tokenizer=tok, **shape)
    letters = string.ascii_lowercase + " "
    text = ["the cat sat on the mat and the dog ate the hat " * 20, "a quick brown fox jumps over the lazy dog " * 20]
    sp = _bpe_tokenizer(text, 45, ["<pad>", "<eos>", "<bos>"], metaspace=True, alphabet=list(letters.replace(" ", "▁")))
    draft = make_model("xtok_sp_draft", num_layers=1, seed=24, vocab_size=len(sp), tokenizer=sp, **shape)
    from specdec.spec_decode.vocab_bridge import VocabBridge, tokenizer_kind

    bridge = VocabBridge.build(tok, sp, len(tok), len(sp))
    assert tokenizer_kind(sp) == "sentencepiece" and bridge.target_to_draft[tok.convert_tokens_to_ids(" ")] == \
        sp.convert_tokens_to_ids("▁")
    assert 20 < bridge.size < len(sp) - 10  # the letters, space and specials; not the merges
    return target, draft


def test_sampled_output_follows_the_target(char_target_and_sp_draft):
    """N = 5000 three-token continuations at temperature 1 against the target's exact joint,
    alpha = 1e-3, with the helper's temperature negative control."""
    from test_spec_distribution import K, check_speculative_samples_follow

    target, draft = char_target_and_sp_draft
    llm = LLM(model=target, dtype="float32", device="cpu", max_model_len=64, max_num_seqs=1000,
              max_num_batched_tokens=8192,
              speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": K})
    check_speculative_samples_follow(llm, target, 5000, "target with a draft of another tokenizer")


def test_negative_control_unrenormalised_q_is_detected(char_target_and_sp_draft, monkeypatch):
    """The same N = 5000 and alpha with q reported as the unrenormalised restriction (half the
    true q: as if half the draft's mass lay outside I) while tokens are still drawn from the true q:
    the chi-square test must reject it, so the passing test above has the power to see a wrong q."""
    import numpy as np
    from test_spec_distribution import PROMPT, chi_square_p, exact_joint, sample_continuations

    from specdec.spec_decode.cross_tokenizer import CrossTokenizerProposer

    flat_probs = CrossTokenizerProposer._flat_probs

    def halved(self, *args):
        q = flat_probs(self, *args)
        return None if q is None else q * 0.5

    monkeypatch.setattr(CrossTokenizerProposer, "_flat_probs", halved)
    target, draft = char_target_and_sp_draft
    llm = LLM(model=target, dtype="float32", device="cpu", max_model_len=64, max_num_seqs=1000,
              max_num_batched_tokens=8192,
              speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 3})
    vocab = llm.engine.vocab_size
    prompt_ids = llm.tokenizer.encode(PROMPT)
    counts = np.zeros((vocab,) * 3, dtype=np.int64)
    for ids in sample_continuations(llm, prompt_ids, 5000, 80_000, dict(temperature=1.0)):
        counts[tuple(ids[:3])] += 1
    p_value = chi_square_p(counts, exact_joint(target, prompt_ids, vocab, temperature=1.0, top_k=0, top_p=1.0))
    assert p_value < 1e-3, f"a wrong q went unnoticed (p = {p_value:.2e})"
