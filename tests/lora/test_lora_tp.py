"""LoRA under tensor parallelism (CPU, gloo, 2 ranks, float32): each rank keeps its slice of the
adapters (B rows of column-parallel linears, A columns of row-parallel ones) and the mixed batch
decodes exactly as on one device."""
from __future__ import annotations

from specdec import LLM, LoRARequest, SamplingParams

ENGINE = dict(dtype="float32", device="cpu", max_model_len=96, enable_lora=True, max_loras=2, max_lora_rank=8)
PROMPTS = ["def f(x):", "import json", "class Decoder(object):", "Hello", "x = [1, 2, 3]"]


def test_mixed_adapters_under_tp_equal_one_device(llama_path, adapters):
    loras = [LoRARequest("all", 1, adapters["all"]), LoRARequest("qv", 2, adapters["qv"]), None]
    per_prompt = [loras[i % 3] for i in range(len(PROMPTS))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    one = LLM(model=llama_path, **ENGINE).generate(PROMPTS, params, use_tqdm=False, lora_request=per_prompt)
    llm = LLM(model=llama_path, tensor_parallel_size=2, **ENGINE,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    try:
        two = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=per_prompt)
    finally:
        llm.engine.executor.shutdown()
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
