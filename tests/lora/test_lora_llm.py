"""LoRA through the offline API: greedy output with adapters equals transformers on the merged
weights (float32) in one batch that mixes two adapters and the base model; speculation stays
lossless with respect to the adapted target; prefix-cache entries are per adapter."""
from __future__ import annotations

import pytest

from specdec import LLM, LoRARequest, SamplingParams
from tests.lora.conftest import hf_greedy, merged_hf_model

ENGINE = dict(dtype="float32", device="cpu", max_model_len=128, enable_lora=True, max_loras=2, max_lora_rank=8)
MAX_TOKENS = 16
PROMPTS = ["def f(x):", "import json", "class Decoder(object):", "for i in range(10):", "Hello", "x = [1, 2, 3]"]


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def loras(adapters) -> dict[str, LoRARequest]:
    return {"all": LoRARequest("all", 1, adapters["all"]), "qv": LoRARequest("qv", 2, adapters["qv"])}


@pytest.fixture(scope="module")
def mixed(loras) -> list[LoRARequest | None]:
    """Per prompt: adapter "all", "qv" or the base model, interleaved."""
    return [[loras["all"], loras["qv"], None][i % 3] for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def llm(llama_path) -> LLM:
    return LLM(model=llama_path, **ENGINE)


@pytest.fixture(scope="module")
def expected(llama_path, adapters, llm, mixed) -> list[list[int]]:
    """transformers' greedy continuation of each prompt under its adapter merged into the weights."""
    models = {None: merged_hf_model(llama_path, None)}
    models.update({name: merged_hf_model(llama_path, path) for name, path in adapters.items()})
    return [hf_greedy(models[lora.lora_name if lora else None], llm.tokenizer.encode(p), MAX_TOKENS)
            for p, lora in zip(PROMPTS, mixed)]


def test_mixed_batch_equals_merged_transformers(llm, mixed, expected):
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False, lora_request=mixed)
    assert [o.outputs[0].token_ids for o in outs] == expected
    # the adapters matter: each adapted prompt differs from the base model's continuation
    base = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    for out, ref, lora in zip(base, expected, mixed):
        assert (out.outputs[0].token_ids == ref) == (lora is None)


def test_one_adapter_for_every_prompt_and_chat(llm, loras, expected, mixed):
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False, lora_request=loras["all"])
    for out, ref, lora in zip(outs, expected, mixed):
        if lora is loras["all"]:
            assert out.outputs[0].token_ids == ref


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3},
    {"method": "draft_model", "num_speculative_tokens": 3},
    {"method": "eagle", "num_speculative_tokens": 3},
])
def test_speculation_is_lossless_with_adapters(llama_path, eagle_head_path, spec, mixed, expected):
    """The draft is the base model's (itself here, or an EAGLE head reading the adapted hidden
    states); verification runs every row under its request's adapter."""
    if spec["method"] != "ngram":
        spec = {**spec, "model": llama_path if spec["method"] == "draft_model" else eagle_head_path}
    llm = LLM(model=llama_path, **ENGINE, speculative_config=spec)
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False, lora_request=mixed)
    assert [o.outputs[0].token_ids for o in outs] == expected
    metrics = llm.get_metrics()
    assert metrics["num_draft_tokens"] > 0


def test_prefix_cache_is_keyed_by_adapter(llm, loras):
    prompt = list(range(3, 3 + 40))  # > 2 blocks of 16
    (base,) = llm.generate([prompt], greedy(), use_tqdm=False)
    hits = llm.get_metrics()["prefix_cache_hits"]
    (adapted,) = llm.generate([prompt], greedy(), use_tqdm=False, lora_request=loras["all"])
    assert llm.get_metrics()["prefix_cache_hits"] == hits  # the base model's blocks are not reused
    (again,) = llm.generate([prompt], greedy(), use_tqdm=False, lora_request=loras["all"])
    assert llm.get_metrics()["prefix_cache_hits"] == hits + 1
    assert again.outputs[0].token_ids == adapted.outputs[0].token_ids != base.outputs[0].token_ids


def test_more_adapters_than_slots(llama_path, adapters, expected, mixed, tmp_path):
    """max_loras=1: the two adapters take turns in the one slot; outputs unchanged."""
    llm = LLM(model=llama_path, **{**ENGINE, "max_loras": 1})
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False, lora_request=mixed)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.executor.driver_worker.lora.num_loads >= 2


def test_request_errors(llm, llama_path, loras, tmp_path):
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(model=llama_path, dtype="float32", device="cpu", max_model_len=128).generate(
            ["a"], greedy(), use_tqdm=False, lora_request=loras["all"])
    with pytest.raises(ValueError, match="2 lora_request entries for 3 prompts"):
        llm.generate(["a", "b", "c"], greedy(), use_tqdm=False, lora_request=[None, loras["all"]])
    with pytest.raises(ValueError, match="lora_int_id 1 already names adapter 'all'"):
        llm.generate(["a"], greedy(), use_tqdm=False, lora_request=LoRARequest("other", 1, loras["qv"].lora_path))
    with pytest.raises(ValueError, match="not a folder"):
        llm.generate(["a"], greedy(), use_tqdm=False, lora_request=LoRARequest("gone", 9, str(tmp_path / "none")))
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("x", 0, "/tmp")
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("quantization", ["int8", "w4a8"])
def test_quantized_target_with_adapters(llama_path, mixed, quantization):
    """The delta is added beside the quantized linear: speculation stays lossless and the adapter
    changes the output."""
    kw = {**ENGINE, "quantization": quantization}
    kw.pop("dtype")
    plain = LLM(model=llama_path, **kw)
    outs = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy(), use_tqdm=False, lora_request=mixed)]
    base = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy(), use_tqdm=False)]
    assert [o != b for o, b in zip(outs, base)] == [lora is not None for lora in mixed]
    spec = LLM(model=llama_path, **kw, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, greedy(), use_tqdm=False,
                                                          lora_request=mixed)] == outs


def test_bf16_adapters_with_dtype_auto_stay_lossless_under_speculation(bf16_llama_path, tmp_path, monkeypatch):
    """dtype "auto" on a bf16 checkpoint streams bf16 pair-layout weights; the adapters go bf16
    through the same row-consistent kernel, so n-gram speculation still equals plain decoding."""
    from specdec.kernels.cpu import woq_cpu
    from specdec.layers import quantization
    from specdec.layers.lora import LoRALinear
    from specdec.worker import device
    from tests.lora.conftest import write_adapter

    if not woq_cpu.bf16_pairs_available():
        pytest.skip("no avx512_bf16 pair kernel on this CPU")
    monkeypatch.setattr(device, "cpu_supports_bf16", lambda: True)
    monkeypatch.setattr(quantization, "bf16_kernel_faster", lambda: True)
    lora = LoRARequest("a", 1, write_adapter(tmp_path / "a", bf16_llama_path, rank=16, seed=3))
    kw = {**ENGINE, "dtype": "auto", "max_lora_rank": 16}
    loras = [lora, None, lora]
    plain = LLM(model=bf16_llama_path, **kw)
    bf16 = plain.engine.executor.driver_worker.apply_model(
        lambda m: [x.bf16 for x in m.modules() if isinstance(x, LoRALinear)])
    assert bf16 and all(bf16)
    outs = [o.outputs[0].token_ids for o in plain.generate(PROMPTS[:3], greedy(), use_tqdm=False, lora_request=loras)]
    base = [o.outputs[0].token_ids for o in plain.generate(PROMPTS[:3], greedy(), use_tqdm=False)]
    assert [o != b for o, b in zip(outs, base)] == [True, False, True]
    spec = LLM(model=bf16_llama_path, **kw, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS[:3], greedy(), use_tqdm=False,
                                                          lora_request=loras)] == outs
