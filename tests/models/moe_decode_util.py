"""Greedy decoding of a mixture-of-experts checkpoint by the engine and by transformers' own model, for
the GGUF MoE tests (``test_gguf_moe.py`` on llama.cpp's files, ``test_gguf_moe_written.py`` on
``gguf_writer_util``'s)."""
from __future__ import annotations

import torch

from specdec import LLM, SamplingParams
from specdec.layers.moe import moe_layers

NUM_NEW = 12  # tokens each prompt decodes
ENGINE = dict(dtype="float32", device="cpu", max_model_len=96, spec_cost_calibration=False)


def model_of(llm: LLM):
    return llm.engine.executor.driver_worker.runner.model


def greedy(llm: LLM, prompts, **kwargs) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, **kwargs)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                          use_tqdm=False)]


def greedy_counting_experts(llm: LLM, prompts) -> tuple[list[list[int]], float]:
    """(``greedy`` tokens, the most experts a MoE layer read per call): above top-k only where the rows
    of a call routed to different experts."""
    layers = moe_layers(model_of(llm))
    for layer in layers:
        layer.stats.reset()
    tokens = greedy(llm, prompts)
    return tokens, max(m.stats.num_experts_read / m.stats.num_calls for m in layers)


def transformers_greedy(model, prompts) -> list[list[int]]:
    """The tokens ``greedy`` must decode: transformers' ``generate`` on each prompt alone."""
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               do_sample=False, max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def assert_w4a8_ngram_lossless(path, prompts) -> None:
    """The checkpoint at ``path`` loaded with ``quantization="w4a8"``: its experts run int8 activations, and
    n-gram speculation decodes ``prompts`` exactly as plain greedy decoding does."""
    llm = LLM(model=path, quantization="w4a8", **ENGINE,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    expert = model_of(llm).layers[0].mlp.experts[0]
    assert expert.gate_up_proj.int8_activations and expert.down_proj.int8_activations
    assert greedy(llm, prompts) == greedy(llm, prompts, use_speculation=False)
