"""``specdec train-draft --arch eagle3`` on a tiny random target: the training-time-test loss, the
reduced draft vocabulary, the speculators folder, resume, and serving it losslessly."""
from __future__ import annotations

import json

import pytest
import torch

from specdec.models.tiny import make_tiny_model
from specdec.training.train_draft import TrainDraftConfig


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("target4"), vocab_size=320, hidden_size=64, num_layers=4,
                           tie_word_embeddings=True, max_position_embeddings=1024)


def _config(target_dir, root, **overrides) -> TrainDraftConfig:
    kwargs = dict(target=str(target_dir), out=str(root / "draft"), work_dir=str(root / "work"), arch="eagle3",
                  sources=("chat", "stdlib"), num_chat_prompts=8, max_new_tokens=12, stdlib_tokens=3000,
                  num_eval_prompts=2, seq_len=32, batch_size=8, gen_batch_size=4, top_k=8, steps=24, lr=3e-3,
                  warmup_steps=2, save_every=4, ttt_steps=3, draft_vocab_size=200, progress=False)
    return TrainDraftConfig(**{**kwargs, **overrides})


def test_training_time_test_loss_matches_a_step_by_step_replay(target_dir):
    """Step j of the loss scores the head fed its own step-(j-1) outputs: recomputing step 2's KL
    from DenseSteps by hand gives the logged value."""
    from specdec.models.eagle3_dense import DenseSteps
    from specdec.models.loader import load_model
    from specdec.training.train_draft import FusedHeadTopKRestKL
    from specdec.training.train_eagle3 import eagle3_loss, init_eagle3

    target = load_model(str(target_dir), torch.float32, torch.device("cpu"))
    head = init_eagle3(target, (1, 2, 3), torch.arange(0, 320, 2), seed=3)
    torch.manual_seed(0)
    ids = torch.randint(0, 320, (2, 10))
    aux = torch.randn(2, 10, 3 * 64)
    logp, top = torch.randn(2, 10, 160).log_softmax(-1).topk(8, dim=-1)
    cfg = TrainDraftConfig(target="t", out="o", ttt_steps=2, num_negatives=0)
    loss, extra = eagle3_loss(head, ids, aux, top.int(), logp, cfg, torch.Generator().manual_seed(0))
    assert set(extra) == {"kl1", "kl2"}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        steps = DenseSteps(head, 2, 9)
        out = steps.step(ids[:, 1:], head.combine(aux[:, :-1]))
        out = steps.step(torch.cat([ids[:, 2:], ids.new_zeros(2, 1)], dim=1), out)
    kl2 = FusedHeadTopKRestKL.apply(head.norm(out[:, :8].float()).flatten(0, 1), head.lm_head.weight.float(),
                                    top[:, 2:].flatten(0, 1).long(), logp[:, 2:].flatten(0, 1))
    assert kl2.item() == pytest.approx(extra["kl2"], abs=2e-3)
    assert loss.item() == pytest.approx(extra["kl1"] + 0.8 * extra["kl2"], abs=2e-3)


def test_eagle3_head_trains_resumes_and_serves(target_dir, tmp_path):
    from safetensors import safe_open

    from specdec import LLM, SamplingParams
    from specdec.training.train_eagle3 import train_eagle3

    train_eagle3(_config(target_dir, tmp_path, max_minutes=0.0))  # killed: stops (after saving) at step 1
    assert torch.load(tmp_path / "work" / "checkpoint.pt")["step"] == 1
    report = train_eagle3(_config(target_dir, tmp_path))           # the same command again: resumes
    log = torch.load(tmp_path / "work" / "checkpoint.pt")["log"]
    assert [r["step"] for r in log] == list(range(1, 25))
    assert {"kl1", "kl2", "kl3"} <= set(log[0]) and "kl4" not in log[0]
    assert sum(r["kl_topk"] for r in log[-3:]) < 0.9 * sum(r["kl_topk"] for r in log[:3])
    chat = report["chat"]
    assert 1.0 <= chat["replayed_accept_len_k5"] <= 6.0 and len(chat["accepted_per_position"]) == 5
    assert report["_stats"]["draft_vocab_size"] == 200
    assert json.loads((tmp_path / "work" / "eval.json").read_text())["chat"] == chat

    folder = tmp_path / "draft"
    config = json.loads((folder / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    assert config["draft_vocab_size"] == 200 and config["target_hidden_size"] == 64
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 2, 1]  # (2, L // 2, L - 3) for 4 layers
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    with safe_open(folder / "model.safetensors", "pt") as f:
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").sum() == 200
        assert f.get_tensor("fc.weight").shape == (64, 3 * 64) and "embed_tokens.weight" not in set(f.keys())
        assert f.get_tensor("layers.0.self_attn.q_proj.weight").shape[1] == 2 * 64

    weights = (folder / "model.safetensors").read_bytes()
    train_eagle3(_config(target_dir, tmp_path))                     # finished: a no-op resume
    assert (folder / "model.safetensors").read_bytes() == weights

    plain = LLM(model=str(target_dir), dtype="float32", device="cpu")
    spec = LLM(model=str(target_dir), dtype="float32", device="cpu", speculative_config={"model": str(folder)})
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = ["def f(x):", "Hello there", "import os"]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert spec.get_metrics()["num_draft_tokens"] > 0
