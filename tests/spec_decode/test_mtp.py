"""``"method": "mtp"``: a tiny DeepSeek-V3 target whose checkpoint carries an MTP layer (written
here: transformers' DeepSeek-V3 does not build one), greedy speculative output identical to plain
decoding for K = 1..4 (K > 1 chains the one layer) and a token tree; sampled output follows the
target's exact distribution (chi-square, as in test_spec_distribution.py: N = 4000 3-token
continuations at temperature 1, alpha 1e-3, a 15% temperature error as the negative control);
a target without MTP weights is refused with a clear error."""
from __future__ import annotations

import pytest
import torch

from specdec import LLM, SamplingParams

ENGINE = dict(dtype="float32", device="cpu", max_model_len=128)
DS = dict(arch="deepseek_v3", num_layers=2, num_heads=4, num_kv_heads=4, moe_intermediate_size=32,
          q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
          n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
          first_k_dense_replace=1, initializer_range=0.05, random_norms_and_biases=True)


def _add_mtp_layer(path: str, seed: int, num_layers: int = DS["num_layers"], num_mtp_layers: int = 1) -> str:
    """Write model.layers.{L + i} for i < num_mtp_layers, in place: the last decoder block's
    weights (layer i > 0: plus noise, so the layers differ), random enorm / hnorm, the final norm
    as shared_head.norm, and an eh_proj that passes the next token's embedding through plus a
    little of h (so its drafts are sometimes right); num_nextn_predict_layers in config.json."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    file = Path(path) / "model.safetensors"
    weights = load_file(str(file))
    hidden = weights["model.embed_tokens.weight"].shape[1]
    gen = torch.Generator().manual_seed(seed)
    last = f"model.layers.{num_layers - 1}."
    for i in range(num_mtp_layers):
        mtp = f"model.layers.{num_layers + i}."
        for name in [n for n in weights if n.startswith(last)]:
            w = weights[name].clone()
            weights[mtp + name[len(last):]] = w + 0.2 * w.std() * torch.randn(w.shape, generator=gen) \
                if i and w.dim() == 2 else w
        for norm in ("enorm", "hnorm"):
            weights[f"{mtp}{norm}.weight"] = 1.0 + 0.1 * torch.randn(hidden, generator=gen)
        weights[f"{mtp}shared_head.norm.weight"] = weights["model.norm.weight"].clone()
        weights[f"{mtp}eh_proj.weight"] = torch.cat([torch.eye(hidden),
                                                     0.05 * torch.randn(hidden, hidden, generator=gen)], dim=1)
        weights[f"{mtp}embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
        weights[f"{mtp}shared_head.head.weight"] = weights["lm_head.weight"].clone()
    save_file(weights, str(file), metadata={"format": "pt"})
    config = json.loads((Path(path) / "config.json").read_text())
    config["num_nextn_predict_layers"] = num_mtp_layers
    (Path(path) / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def target(make_model):
    return _add_mtp_layer(make_model("deepseek_v3_mtp", **DS), seed=1)


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer, prompts):
    return [tiny_tokenizer.encode(s) for s in prompts[:5]] + [tiny_tokenizer.encode(prompts[10])]


@pytest.fixture(scope="module")
def plain(target, prompts):
    llm = LLM(model=target, **ENGINE)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("spec", [{"num_speculative_tokens": k} for k in (1, 2, 3, 4)]
                         + [{"num_speculative_tokens": 3, "tree_topk": 2, "tree_nodes": 6}],
                         ids=["k1", "k2", "k3", "k4", "tree"])
def test_greedy_equals_plain(target, prompts, plain, spec):
    llm = LLM(model=target, **ENGINE, speculative_config={"method": "mtp", **spec})
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, use_speculation=bool(i % 3))
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    metrics = llm.get_metrics()
    assert metrics["num_draft_tokens"] > 0 and metrics["num_accepted_tokens"] > 0


@pytest.fixture(scope="module")
def two_layer_target(make_model):
    return _add_mtp_layer(make_model("deepseek_v3_mtp2", **DS), seed=5, num_mtp_layers=2)


@pytest.mark.parametrize("spec", [{"num_speculative_tokens": 3}, {"num_speculative_tokens": 3, "tree_topk": 2,
                                                                  "tree_nodes": 6}], ids=["k3", "tree"])
def test_two_mtp_layers_greedy_equals_plain(two_layer_target, prompts, spec):
    """Both layers load (each its own cache layer); draft 1 from layer 0, drafts 2 and 3 from
    layer 1; output identical to plain decoding of the same target."""
    plain = LLM(model=two_layer_target, **ENGINE).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    llm = LLM(model=two_layer_target, **ENGINE, speculative_config={"method": "mtp", **spec})
    head = llm.engine.executor.driver_worker.proposer.runner.model
    assert head.num_layers == 2 and len(llm.engine.executor.driver_worker.proposer.runner.kv_caches) == 2
    assert not torch.equal(head.layers[0].self_attn.kv_b_proj.weight, head.layers[1].self_attn.kv_b_proj.weight)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert llm.get_metrics()["num_accepted_tokens"] > 0


def test_pass_i_runs_layer_min_i_n_minus_1(two_layer_target):
    """The layer each pass runs: the chaining rule, and the catch-up writes both cache layers."""
    from specdec.models.loader import iterate_weights, load_model
    from specdec.spec_decode.mtp import MTPHead

    head = MTPHead(load_model(two_layer_target, torch.float32, torch.device("cpu")))
    head.load_weights(iterate_weights(two_layer_target))
    ran = []
    for i, layer in enumerate(head.layers):
        layer.register_forward_hook(lambda *_, i=i: ran.append(i))
    from specdec.worker.model_runner import ModelRunner

    runner = ModelRunner(head, 8, 8, torch.device("cpu"), torch.float32)
    for draft_pass, expected in ((0, [0, 1]), (1, [1]), (2, [1]), (5, [1])):
        ran.clear()
        head.draft_pass = draft_pass
        batch = runner.prepare([[5, 6, 7]], [0], [[0]], [[2]])
        batch.features = torch.randn(3, head.config.hidden_size)
        runner.forward(batch)
        assert ran == expected, draft_pass
    assert all(c.abs().sum() > 0 for c in runner.kv_caches)


def test_a_target_without_mtp_weights_is_refused(make_model):
    path = make_model("deepseek_v3_no_mtp", **dict(DS, num_layers=1, first_k_dense_replace=0))
    with pytest.raises(ValueError, match="no MTP layer"):
        LLM(model=path, **ENGINE, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="model must be unset"):
        LLM(model=path, **ENGINE, speculative_config={"method": "mtp", "model": path, "num_speculative_tokens": 2})


def test_head_matches_a_transformers_built_mtp_layer(target, prompts):
    """Our MTP head's logits for a prompt, fed the target's final hidden states, against the layer
    assembled from transformers' own DeepSeek-V3 decoder block: eh_proj([enorm(embed(t_{p+1})),
    hnorm(h_p)]) -> block -> shared_head.norm -> LM head."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3DecoderLayer, DeepseekV3RMSNorm, DeepseekV3RotaryEmbedding,
    )

    from specdec.models.loader import iterate_weights, load_model
    from specdec.spec_decode.mtp import MTPHead
    from specdec.worker.model_runner import ModelRunner

    cpu = torch.device("cpu")
    ids = prompts[5]
    model = load_model(target, torch.float32, cpu)
    head = MTPHead(model)
    head.load_weights(iterate_weights(target))
    runner, head_runner = (ModelRunner(m, 16, 8, cpu, torch.float32) for m in (model, head))
    table = [list(range(-(-len(ids) // 8)))]
    _, hidden = runner.forward_with_hidden(runner.prepare([ids], [0], table, [[0]]))
    batch = head_runner.prepare([ids[1:]], [0], table, [list(range(len(ids) - 1))])
    batch.features = hidden[:-1]
    ours = head_runner.forward(batch)

    config = AutoConfig.from_pretrained(target)
    config._attn_implementation = "eager"
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    weights = load_file(f"{target}/model.safetensors")
    prefix = f"model.layers.{config.num_hidden_layers}."
    block = DeepseekV3DecoderLayer(config, config.num_hidden_layers).eval()
    state = {n[len(prefix):]: t for n, t in weights.items() if n.startswith(prefix)
             and n[len(prefix):].split(".")[0] in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")}
    experts = range(config.n_routed_experts)  # transformers keeps them stacked: [E, 2I, H] and [E, H, I]
    state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([state.pop(f"mlp.experts.{e}.gate_proj.weight"),
                                                                state.pop(f"mlp.experts.{e}.up_proj.weight")])
                                                     for e in experts])
    state["mlp.experts.down_proj"] = torch.stack([state.pop(f"mlp.experts.{e}.down_proj.weight") for e in experts])
    block.load_state_dict(state)
    norms = {}
    for name in ("enorm", "hnorm", "shared_head.norm"):
        norms[name] = DeepseekV3RMSNorm(config.hidden_size, config.rms_norm_eps)
        norms[name].weight.data.copy_(weights[f"{prefix}{name}.weight"])
    with torch.no_grad():
        h = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, :-1]  # after the final norm
        emb = hf.model.embed_tokens(torch.tensor(ids[1:]))
        x = torch.cat([norms["enorm"](emb), norms["hnorm"](h)], dim=-1) @ weights[f"{prefix}eh_proj.weight"].t()
        n = len(ids) - 1
        rope = DeepseekV3RotaryEmbedding(config)(x[None], torch.arange(n)[None])
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = block(x[None], attention_mask=mask, position_embeddings=rope)[0]
        expected = hf.lm_head(norms["shared_head.norm"](out))
    torch.testing.assert_close(hidden[:-1], h, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)


def test_sampled_output_follows_the_target(make_model, make_char_tokenizer):
    from test_spec_distribution import K, check_speculative_samples_follow

    tok = make_char_tokenizer()
    shape = dict(DS, vocab_size=len(tok), hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=64,
                 tokenizer=tok, seed=31)
    target = _add_mtp_layer(make_model("deepseek_v3_mtp_chars", **shape), seed=2)
    llm = LLM(model=target, dtype="float32", device="cpu", max_model_len=64, max_num_seqs=1000,
              max_num_batched_tokens=8192, speculative_config={"method": "mtp", "num_speculative_tokens": K})
    check_speculative_samples_follow(llm, target, 4000, "target with MTP drafts")
