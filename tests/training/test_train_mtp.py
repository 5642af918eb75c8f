"""MTP-layer distillation (``specdec.training.train_mtp``) on a tiny DeepSeek-V3 target: a few
steps lower the loss on a fixed batch, the layer's first pass matches what the engine's MTP head
computes from the saved checkpoint, and the saved folder loads as ``"method": "mtp"`` with
greedy output equal to plain decoding."""
from __future__ import annotations

import pytest
import torch

from specdec import LLM, SamplingParams

DS = dict(arch="deepseek_v3", num_layers=2, num_heads=4, num_kv_heads=4, moe_intermediate_size=32,
          q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
          n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
          first_k_dense_replace=1, initializer_range=0.05)


@pytest.fixture(scope="module")
def trained(make_model, tiny_tokenizer, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from specdec.training.train_mtp import MTPLayer, save_target_with_mtp, teacher_states, train_mtp

    target = AutoModelForCausalLM.from_pretrained(make_model("deepseek_v3_train_mtp", **DS), dtype=torch.float32)
    target.eval().requires_grad_(False)
    ids = torch.randint(3, 300, (4, 24), generator=torch.Generator().manual_seed(0))
    hidden, logp = teacher_states(target, ids)
    layer = MTPLayer(target)
    torch.manual_seed(0)
    losses = train_mtp(layer, hidden, ids, logp, steps=12, batch_size=4, lr=3e-3, unroll=2, progress=False)
    out = save_target_with_mtp(target, layer, tiny_tokenizer, tmp_path_factory.mktemp("mtp_trained"))
    return layer, hidden, ids, losses, str(out)


def test_a_few_steps_lower_the_loss(trained):
    _, _, _, losses, _ = trained
    assert len(losses) == 12 and all(l == l for l in losses)
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses


def test_saved_layer_is_what_the_engine_reads(trained):
    """Pass 1 of the trained layer (transformers' block) against the engine's MTP head on the
    saved checkpoint, fed the same target states."""
    from specdec.models.loader import iterate_weights, load_model
    from specdec.spec_decode.mtp import MTPHead
    from specdec.worker.model_runner import ModelRunner

    layer, hidden, ids, _, path = trained
    cpu = torch.device("cpu")
    head = MTPHead(load_model(path, torch.float32, cpu))
    head.load_weights(iterate_weights(path))
    runner = ModelRunner(head, 8, 8, cpu, torch.float32)
    row = ids[0].tolist()
    batch = runner.prepare([row[1:]], [0], [list(range(3))], [list(range(len(row) - 1))])
    batch.features = hidden[0, :-1]
    with torch.no_grad():
        _, expected = layer(hidden[:1, :-1], ids[:1, 1:])
    torch.testing.assert_close(runner.forward(batch), expected[0], rtol=1e-4, atol=1e-4)


def test_saved_folder_drafts_as_mtp(trained, tiny_tokenizer, prompts):
    path = trained[-1]
    batch = [tiny_tokenizer.encode(p) for p in prompts[:3]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine = dict(dtype="float32", device="cpu", max_model_len=64)
    plain = LLM(model=path, **engine).generate(batch, params, use_tqdm=False)
    llm = LLM(model=path, **engine, speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    outs = llm.generate(batch, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert llm.get_metrics()["num_draft_tokens"] > 0
