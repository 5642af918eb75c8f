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
length changes the padding (the first difference a w4a8 engine run showed, prefix caching on)."""
import pytest
import torch

from specdec import LLM

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
