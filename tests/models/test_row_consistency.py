"""A token's row is computed the same, bit for bit, whether it is a one-row decode step or row j
of a K+1-row verification forward (alone, or next to other requests' rows): every op's output
(embedding, norms, QKV, rotary, attention, MLP, LM head) is compared through forward hooks.

This is what lets the int8-activation linears ("w8a8" / "w4a8") stay lossless under speculation:
a layer that rounds its input to int8 is a step function of it, so one ulp of difference from an
op that summed a row differently in a bigger call could change a quantized activation.
Checked in float32 for weight-only int4 and for int8 activations ("w4a8"), with the attention
backend "auto" picks for w4a8 on CPU ("rows": each query row on its own,
``specdec.kernels.cpu.attention_rows``). The batched "torch" backend is not row-consistent: its
matmuls over the step's padded batch sum a row differently when another request's prefill
length changes the padding (the first difference a w4a8 engine run showed, prefix caching on).

The sweep (``FAMILIES``: every architecture the engine loads, hidden 512, two layers, each
family's own parts on: sliding windows, sinks, q/k norms, biases, partial rotary and LongRoPE,
softcapping, many experts with near-tied routers, MLA with both attention forms and MTP) runs
each through the engine in float32: a prompt decoded alone equals the same prompt decoded in a
batch of 8 mixed prompts, and speculative (n-gram; MTP for DeepSeek-V3) equals plain decoding,
token for token and logprob for logprob.
"""
import pytest
import torch

from specdec import LLM, SamplingParams

ENGINE = dict(dtype="float32", device="cpu", max_model_len=256, spec_cost_calibration=False)
K = 4


@pytest.fixture(scope="module")
def wide_llama_path(make_model) -> str:
    """head_dim 64, 9 query / 3 kv heads (SmolLM2-135M's attention shape), in_features multiples of 64."""
    return make_model("wide_llama", arch="llama", hidden_size=576, num_heads=9, num_kv_heads=3,
                      intermediate_size=1536, initializer_range=0.05, random_norms_and_biases=True)


class Recorder:
    """The output of every leaf module (and every attention module) of each forward, by name."""

    def __init__(self, model):
        self.outputs: dict[str, torch.Tensor] = {}
        for name, module in model.named_modules():
            if name and (not list(module.children()) or name.endswith("self_attn")):
                module.register_forward_hook(self._hook(name))

    def _hook(self, name):
        def record(module, inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            self.outputs[name] = out.detach().clone()
        return record


def run(runner, recorder, requests) -> dict[str, torch.Tensor]:
    """One forward of ``requests`` [(token ids, first position, block ids)], logits for every row."""
    recorder.outputs.clear()
    batch = runner.prepare([r[0] for r in requests], [r[1] for r in requests], [r[2] for r in requests],
                           [list(range(len(r[0]))) for r in requests])
    runner.forward(batch)
    return dict(recorder.outputs)


@pytest.mark.parametrize("quantization,backend", [("int4", "rows"), ("w4a8", "auto")])
def test_a_decode_row_equals_that_row_of_a_verification_forward_bitwise(wide_llama_path, quantization, backend):
    llm = LLM(model=wide_llama_path, **ENGINE, quantization=quantization, attention_backend=backend)
    runner = llm.engine.executor.driver_worker.runner
    assert runner.model.layers[0].self_attn.backend.name == "rows"
    recorder = Recorder(runner.model)
    vocab = runner.model.embed_tokens.weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    len_a, len_b = 45, 90
    a = torch.randint(3, vocab, (len_a + K + 1,), generator=gen).tolist()
    b = torch.randint(3, vocab, (len_b + K + 1,), generator=gen).tolist()
    per = 112 // runner.block_size + 1
    blocks_a, blocks_b = list(range(1, 1 + per)), list(range(1 + per, 1 + 2 * per))

    def fresh():  # both prompts prefilled the same way before each scenario
        for cache in runner.kv_caches:
            cache.zero_()
        run(runner, recorder, [(a[:len_a], 0, blocks_a)])
        run(runner, recorder, [(b[:len_b], 0, blocks_b)])

    fresh()
    decoded = [run(runner, recorder, [([a[len_a + j]], len_a + j, blocks_a)]) for j in range(K + 1)]
    verify_a = (a[len_a:len_a + K + 1], len_a, blocks_a)
    scenarios = {  # name -> (requests, row offset of A's verification rows)
        "alone": ([verify_a], 0),
        "next to a decode row": ([([b[len_b]], len_b, blocks_b), verify_a], 1),
        "next to another verification": ([verify_a, (b[len_b:len_b + K + 1], len_b, blocks_b)], 0),
        "next to a prefill chunk": ([verify_a, (b[len_b:len_b + 20], len_b, blocks_b)], 0),
    }
    ops = set(decoded[0])
    assert {"embed_tokens", "layers.0.input_layernorm", "layers.0.self_attn.qkv_proj", "layers.0.self_attn",
            "layers.1.mlp.down_proj", "norm", "lm_head"} <= ops, sorted(ops)
    for name, (requests, offset) in scenarios.items():
        fresh()
        verified = run(runner, recorder, requests)
        for j in range(K + 1):
            for op, out in decoded[j].items():
                assert out.shape[0] == 1, op
                assert torch.equal(out[0], verified[op][offset + j]), f"{name}: row {j} differs at {op}"

    # a prompt's prefill rows next to another request's long prefill, short prefill or decode row
    # (prefix caching and chunked prefill change these partners between two runs of one prompt)
    # (up to 17 rows per request the torch backend pads the step's requests to one shape)
    short = 13

    def prefill_a_next_to(partner):
        for cache in runner.kv_caches:
            cache.zero_()
        if partner:
            run(runner, recorder, [(b[:len_b - partner], 0, blocks_b)])
        requests = [(a[:short], 0, blocks_a)] + ([(b[len_b - partner:len_b], len_b - partner, blocks_b)] if partner else [])
        return run(runner, recorder, requests)

    alone = prefill_a_next_to(0)
    for partner in (1, 5, 17, 40):
        beside = prefill_a_next_to(partner)
        for op, out in alone.items():
            assert torch.equal(out, beside[op][:short]), f"prefill next to {partner} rows differs at {op}"


# ---- every family: alone vs in a batch of 8, speculative vs plain ----

WIDE = dict(hidden_size=512, num_layers=2, num_heads=8, num_kv_heads=2, intermediate_size=1024,
            initializer_range=0.05, random_norms_and_biases=True)
MLA = dict(num_heads=8, num_kv_heads=8, qk_rope_head_dim=32, n_shared_experts=1, first_k_dense_replace=1,
           moe_intermediate_size=128)
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(16)],
            "long_factor": [2.0 + 0.5 * i for i in range(16)]}
FAMILIES = {
    "llama": dict(arch="llama"),
    "mistral": dict(arch="mistral", sliding_window=32),
    "qwen2": dict(arch="qwen2"),  # q/k/v biases
    "qwen3": dict(arch="qwen3", head_dim=64),  # q/k norms
    # routers left at transformers' scale: 64 experts' logits lie close, so top-8 choices sit near ties
    "qwen3_moe": dict(arch="qwen3_moe", head_dim=64, num_experts=64, num_experts_per_tok=8,
                      moe_intermediate_size=128, norm_topk_prob=True, mlp_only_layers=[1]),
    "mixtral": dict(arch="mixtral", num_local_experts=8, num_experts_per_tok=2, intermediate_size=256,
                    sliding_window=32),
    "gpt_oss": dict(arch="gpt_oss", head_dim=64, num_local_experts=32, num_experts_per_tok=4, intermediate_size=128,
                    sliding_window=32),  # sinks, sliding / full layers, clamped SwiGLU with biases
    "gemma3": dict(arch="gemma3", head_dim=64, sliding_window=32, sliding_window_pattern=2, query_pre_attn_scalar=64,
                   final_logit_softcapping=30.0),
    # LongRoPE switching at 32: long prompts and prompts whose generation crosses it
    "phi3": dict(arch="phi3", sliding_window=48, max_position_embeddings=256, original_max_position_embeddings=32,
                 partial_rotary_factor=0.5, rope_scaling=LONGROPE),
    # MLA absorbed throughout (latent 64: the expanded form never pays)
    "deepseek_v2": dict(arch="deepseek_v2", **MLA, q_lora_rank=None, kv_lora_rank=64, qk_nope_head_dim=64,
                        v_head_dim=64, n_routed_experts=16, num_experts_per_tok=4, topk_method="group_limited_greedy",
                        n_group=4, topk_group=2, routed_scaling_factor=1.5),
    # latent 128: prefill chunks of 43+ rows take the expanded form; an MTP layer drafts
    "deepseek_v3": dict(arch="deepseek_v3", **MLA, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32,
                        v_head_dim=32, n_routed_experts=32, num_experts_per_tok=4, n_group=4, topk_group=2,
                        routed_scaling_factor=2.5),
}
NUM_NEW = 16
SPEC = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3, "num_speculative_tokens": K}


def add_mtp_layer(path: str) -> str:
    """A DeepSeek-V3 checkpoint's MTP layer (``model.layers.<L>``: transformers builds none), in place:
    the last decoder block's weights, random enorm / hnorm, an ``eh_proj`` that passes the token's
    embedding through plus a little of h, and ``num_nextn_predict_layers`` in config.json."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    file = Path(path) / "model.safetensors"
    weights = load_file(str(file))
    config = json.loads((Path(path) / "config.json").read_text())
    last, mtp = f"model.layers.{config['num_hidden_layers'] - 1}.", f"model.layers.{config['num_hidden_layers']}."
    hidden = config["hidden_size"]
    gen = torch.Generator().manual_seed(5)
    weights.update({mtp + n[len(last):]: w.clone() for n, w in list(weights.items()) if n.startswith(last)})
    for norm in ("enorm", "hnorm"):
        weights[f"{mtp}{norm}.weight"] = 1.0 + 0.1 * torch.randn(hidden, generator=gen)
    weights[f"{mtp}shared_head.norm.weight"] = weights["model.norm.weight"].clone()
    weights[f"{mtp}eh_proj.weight"] = torch.cat([torch.eye(hidden), 0.05 * torch.randn(hidden, hidden, generator=gen)],
                                                dim=1)
    save_file(weights, str(file), metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 1
    (Path(path) / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, make_model) -> tuple[str, str]:
    path = make_model(f"rows_{request.param}", **{**WIDE, **FAMILIES[request.param]})
    return request.param, add_mtp_layer(path) if request.param == "deepseek_v3" else path


def mixed_prompts(vocab: int) -> list[list[int]]:
    """8 prompts of 3 to 60 tokens, each a short random phrase repeated (n-gram drafts find matches)."""
    gen = torch.Generator().manual_seed(1)
    prompts = []
    for length, phrase in ((5, 3), (60, 7), (12, 4), (33, 5), (3, 3), (47, 6), (20, 2), (9, 9)):
        words = torch.randint(3, vocab, (phrase,), generator=gen).tolist()
        prompts.append((words * (length // phrase + 1))[:length])
    return prompts


def decode(llm: LLM, prompts: list[list[int]], use_speculation: bool) -> list[tuple[list[int], list]]:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=3,
                            use_speculation=use_speculation)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("quantization", [None, "w4a8"])
def test_a_prompt_decodes_the_same_alone_in_a_batch_and_speculatively(family, quantization):
    """Unquantized, the float32 linears are BLAS GEMMs, whose rows are not bitwise the same in
    every batch (a last-bit difference almost never moves a greedy token: the tokens are
    compared); with ``w4a8`` every op is row-consistent, and the logprobs are compared too."""
    name, path = family
    methods = [SPEC] + ([{"method": "mtp", "num_speculative_tokens": 2}] if name == "deepseek_v3" else [])
    for spec in methods:
        llm = LLM(model=path, **ENGINE, quantization=quantization, max_num_seqs=8, speculative_config=spec)
        prompts = mixed_prompts(llm.engine.executor.driver_worker.runner.model.embed_tokens.weight.shape[0])
        batched = decode(llm, prompts, use_speculation=False)
        if spec is SPEC:  # alone (prefix-cache hits from the batch: each prompt's tail prefilled on its own)
            for i, prompt in enumerate(prompts):
                alone = decode(llm, [prompt], use_speculation=False)[0]
                assert alone[0] == batched[i][0], f"{name}: prompt {i} alone decodes other tokens"
                assert quantization is None or alone[1] == batched[i][1], f"{name}: prompt {i} alone: other logprobs"
        speculative = decode(llm, prompts, use_speculation=True)
        assert llm.get_metrics()["num_draft_tokens"] > 0, f"{name}: {spec['method']} drafted nothing"
        for i, (ours, plain) in enumerate(zip(speculative, batched)):
            assert ours[0] == plain[0], f"{name}: {spec['method']} speculative tokens differ, prompt {i}"
            assert quantization is None or ours[1] == plain[1], \
                f"{name}: {spec['method']} speculative logprobs differ, prompt {i}"


def test_longrope_switch_inside_a_verification(make_model):
    """A request at 30 positions verifies rows 30..34 across LongRoPE's switch (32): row 30 of the
    verification must equal the one-row decode of position 30."""
    llm = LLM(model=make_model("rows_phi3", **{**WIDE, **FAMILIES["phi3"]}), **ENGINE, quantization="w4a8")
    runner = llm.engine.executor.driver_worker.runner
    recorder = Recorder(runner.model)
    tokens = torch.randint(3, 300, (35,), generator=torch.Generator().manual_seed(0)).tolist()
    blocks = list(range(1, 1 + 64 // runner.block_size + 1))
    run(runner, recorder, [(tokens[:30], 0, blocks)])
    decoded = run(runner, recorder, [(tokens[30:31], 30, blocks)])["lm_head"]
    verified = run(runner, recorder, [(tokens[30:35], 30, blocks)])["lm_head"]
    assert torch.equal(decoded[0], verified[0])
