"""A draft model's reduced vocabulary (``speculative_config["draft_vocab_size"]``, FR-Spec): which
tokens it keeps, the cut LM head, and speculation staying lossless with drafts confined to it."""
import json

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.config import SpeculativeConfig
from specdec.models.loader import load_model
from specdec.spec_decode import draft_vocab
from specdec.spec_decode.draft_vocab import draft_vocabulary, restrict_lm_head, token_ranking

ENGINE = dict(dtype="float32", device="cpu", max_model_len=96, spec_cost_calibration=False)


@pytest.fixture()
def counts(monkeypatch, tiny_tokenizer):
    """A small frequency table instead of the standard library's (same interface)."""
    table = {40: 9, 7: 8, 300: 7, 5: 1}
    monkeypatch.setattr(draft_vocab, "stdlib_token_counts", lambda tokenizer: dict(table))
    return table


def test_the_built_in_ranking_alternates_counted_tokens_with_id_order(counts, tiny_tokenizer):
    ranked = token_ranking(tiny_tokenizer, 512)
    assert ranked[:8] == [40, 0, 7, 1, 300, 2, 5, 3]  # counted (by count) and id order, taken in turn
    assert sorted(ranked) == list(range(512))  # every id once


def test_a_token_file_ranks_first_and_bad_files_are_named(tmp_path, tiny_tokenizer):
    listed = tmp_path / "hot.json"
    listed.write_text(json.dumps([9, 3, 9, 70]))
    assert token_ranking(tiny_tokenizer, 100, str(listed))[:4] == [9, 3, 70, 0]
    as_tensor = tmp_path / "hot.pt"
    torch.save(torch.tensor([11, 4]), as_tensor)
    kept = draft_vocabulary(tiny_tokenizer, 512, None, str(as_tensor))  # no size: every listed token
    assert set(kept.tolist()) == {11, 4} | set(tiny_tokenizer.all_special_ids)
    listed.write_text(json.dumps([1, 512]))
    with pytest.raises(ValueError, match="draft_vocab.*512.*outside the vocabulary"):
        token_ranking(tiny_tokenizer, 512, str(listed))
    garbage = tmp_path / "hot.pt"
    garbage.write_bytes(b"not a tensor")
    with pytest.raises(ValueError, match="draft_vocab: cannot read"):
        token_ranking(tiny_tokenizer, 512, str(garbage))
    with pytest.raises(ValueError, match="draft_vocab: no file"):
        draft_vocabulary(tiny_tokenizer, 512, 300, str(tmp_path / "missing.json"))


def test_size_limits_and_the_special_tokens(counts, tiny_tokenizer):
    kept = draft_vocabulary(tiny_tokenizer, 512, 256)
    assert kept.tolist() == sorted(kept.tolist())
    assert {40, 7, 300}.issubset(kept.tolist()) and set(tiny_tokenizer.all_special_ids).issubset(kept.tolist())
    assert len(kept) <= 256 + len(tiny_tokenizer.all_special_ids)
    for bad in (0, 513):
        with pytest.raises(ValueError, match=r"draft_vocab_size must be in 1\.\.512"):
            draft_vocabulary(tiny_tokenizer, 512, bad)


def test_config_rejects_a_draft_vocabulary_where_it_cannot_apply():
    with pytest.raises(ValueError, match="draft_vocab_size / draft_vocab apply to method 'draft_model'"):
        SpeculativeConfig(method="ngram", draft_vocab_size=1000)
    with pytest.raises(ValueError, match="draft_vocab_size must be an int"):
        SpeculativeConfig(model="m", draft_vocab_size="1000")


def test_the_cut_head_gives_the_kept_columns_of_the_full_logits(noisy_draft_path):
    model = load_model(noisy_draft_path, torch.float32, torch.device("cpu"))
    hidden = torch.randn(3, model.config.hidden_size)
    full = model.compute_logits(hidden)
    kept = torch.tensor([0, 5, 17, 300])
    restrict_lm_head(model, kept)
    assert model.lm_head.out_features == 4
    torch.testing.assert_close(model.compute_logits(hidden), full[:, kept])


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_speculation_with_a_draft_vocabulary_equals_plain_decoding(llama_path, noisy_draft_path, prompts, tmp_path,
                                                                   tree):
    """Half the vocabulary kept (the tokens the prompts hold among them): greedy output equals
    plain decoding, drafts are accepted, and no draft leaves the kept set."""
    chosen = prompts[:4]
    llm_plain = LLM(model=llama_path, **ENGINE)
    tok = llm_plain.tokenizer
    vocab = llm_plain.engine.vocab_size
    in_prompts = sorted({t for p in chosen for t in tok.encode(p)})
    keep = list(dict.fromkeys(in_prompts + list(range(vocab))))[: vocab // 2]
    hot = tmp_path / "hot.json"
    hot.write_text(json.dumps(keep))
    spec = {"method": "draft_model", "model": noisy_draft_path, "num_speculative_tokens": 3,
            "draft_vocab": str(hot), "draft_vocab_size": vocab // 2}
    if tree:
        spec.update(tree_topk=2, tree_nodes=6)
    llm = LLM(model=llama_path, **ENGINE, speculative_config=spec)
    worker = llm.engine.executor.driver_worker
    assert worker.draft_runner.model.lm_head.out_features <= vocab // 2 + len(tok.all_special_ids)
    drafted = []
    propose = worker.proposer.propose
    worker.proposer.propose = lambda *a, **k: (lambda out: drafted.extend(t for d in out.draft_token_ids for t in d) or out)(
        propose(*a, **k))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    spec_tokens = [o.outputs[0].token_ids for o in llm.generate(chosen, params, use_tqdm=False)]
    plain_tokens = [o.outputs[0].token_ids for o in llm_plain.generate(chosen, params, use_tqdm=False)]
    assert spec_tokens == plain_tokens
    assert llm.get_metrics()["num_accepted_tokens"] > 0
    assert drafted and set(drafted) <= set(keep) | set(tok.all_special_ids)


@pytest.mark.parametrize("temperatures", [(0.0,), (0.0, 0.8)], ids=["greedy", "greedy-and-sampled"])
def test_greedy_chains_read_the_kept_columns_and_propose_what_the_full_width_does(
        llama_path, noisy_draft_path, prompts, tmp_path, temperatures):
    """A greedy chain takes its argmax and confidence test on the draft's own columns (no
    [N, target vocab] tensor); every proposal, drafts and q, equals the full-width path's."""
    chosen = prompts[:4]
    vocab = LLM(model=llama_path, **ENGINE).engine.vocab_size
    hot = tmp_path / "hot.json"
    hot.write_text(json.dumps(list(range(0, vocab, 2))))
    spec = {"method": "draft_model", "model": noisy_draft_path, "num_speculative_tokens": 3, "draft_vocab": str(hot),
            "draft_vocab_size": vocab // 2, "draft_confidence_threshold": 0.2}
    params = [SamplingParams(temperature=temperatures[i % len(temperatures)], seed=i, max_tokens=12, ignore_eos=True)
              for i in range(len(chosen))]
    runs = []
    for narrow in (True, False):
        llm = LLM(model=llama_path, **ENGINE, seed=0, speculative_config=spec)
        proposer = llm.engine.executor.driver_worker.proposer
        assert proposer.narrow_greedy  # ascending kept ids
        proposer.narrow_greedy = narrow
        proposals, widened = [], []
        propose, widen = proposer.propose, proposer._widen

        def recorded(*args, _propose=propose, _proposals=proposals, **kwargs):
            out = _propose(*args, **kwargs)
            _proposals.append((out.draft_token_ids, None if out.draft_probs is None else out.draft_probs.clone()))
            return out

        proposer.propose = recorded
        proposer._widen = lambda logits, _widen=widen, _widened=widened: _widened.append(1) or _widen(logits)
        outputs = [o.outputs[0].token_ids for o in llm.generate(chosen, params, use_tqdm=False)]
        runs.append((outputs, proposals, len(widened)))
    (narrow_out, narrow_props, narrow_widened), (full_out, full_props, full_widened) = runs
    assert narrow_out == full_out
    assert len(narrow_props) == len(full_props) and any(any(d) for d, _ in narrow_props)
    for (drafts, q), (full_drafts, full_q) in zip(narrow_props, full_props):
        assert drafts == full_drafts
        assert (q is None and full_q is None) or torch.equal(q, full_q)
    assert full_widened > 0
    if len(temperatures) == 1:  # all greedy: no pass built the full width
        assert narrow_widened == 0
    else:  # sampled rows need q over the target's vocabulary
        assert any(q is not None for _, q in narrow_props) and narrow_widened > 0
