"""A draft's own LM head format (``speculative_config.draft_lm_head_quantization``): it follows the
draft's weight format unless set, the setting is validated naming the field, and an int4 head keeps
speculation lossless (greedy, float32 target: speculative output equals plain decoding)."""
import pytest

from specdec import LLM, SamplingParams
from specdec.config import SpeculativeConfig
from specdec.layers.quantization import WeightOnlyLinear

ENGINE = dict(dtype="float32", device="cpu", max_model_len=96, spec_cost_calibration=False)


def greedy_tokens(llm, prompts, use_speculation=True):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, use_speculation=use_speculation)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("head, int4_head", [(None, True), ("int4", True), ("int8", False)],
                         ids=["default", "int4", "int8"])
def test_the_draft_lm_head_takes_the_asked_format_and_stays_lossless(llama_path, noisy_draft_path, prompts,
                                                                     head, int4_head):
    chosen = prompts[:4]
    spec = {"method": "draft_model", "model": noisy_draft_path, "num_speculative_tokens": 3, "quantization": "int4",
            "draft_lm_head_quantization": head}
    llm = LLM(model=llama_path, **ENGINE, speculative_config=spec)
    worker = llm.engine.executor.driver_worker
    draft_head = worker.draft_runner.model.lm_head
    assert isinstance(draft_head, WeightOnlyLinear) and draft_head.int4 == int4_head
    # the body stays int4 whatever the head; the float32 target is untouched
    assert all(m.int4 for name, m in worker.draft_runner.model.named_modules()
               if isinstance(m, WeightOnlyLinear) and name != "lm_head")
    assert not any(isinstance(m, WeightOnlyLinear) for m in worker.runner.model.modules())
    if head != "int8":  # the greedy check once per int4 head (the int8 head's is test_woq_target's)
        assert greedy_tokens(llm, chosen) == greedy_tokens(llm, chosen, use_speculation=False)
        assert llm.get_metrics()["num_accepted_tokens"] > 0


def test_an_int8_draft_keeps_an_int8_head_by_default(llama_path, noisy_draft_path):
    llm = LLM(model=llama_path, **ENGINE, speculative_config={
        "method": "draft_model", "model": noisy_draft_path, "num_speculative_tokens": 2, "quantization": "int8"})
    head = llm.engine.executor.driver_worker.draft_runner.model.lm_head
    assert isinstance(head, WeightOnlyLinear) and not head.int4


def test_the_field_is_validated_naming_it():
    with pytest.raises(ValueError, match=r"draft_lm_head_quantization must be one of \('int8', 'int4'\)"):
        SpeculativeConfig(model="m", quantization="w4a8", draft_lm_head_quantization="int2")
    with pytest.raises(ValueError, match="draft_lm_head_quantization needs speculative_config.quantization"):
        SpeculativeConfig(model="m", draft_lm_head_quantization="int4")
    with pytest.raises(ValueError, match="draft_lm_head_quantization needs speculative_config.quantization"):
        SpeculativeConfig(model="m", quantization="fp8", draft_lm_head_quantization="int8")
    with pytest.raises(ValueError, match="draft_lm_head_quantization applies to method 'draft_model' or 'eagle3'"):
        SpeculativeConfig(method="eagle", model="m", quantization="int4", draft_lm_head_quantization="int4")
    with pytest.raises(ValueError, match="draft_lm_head_quantization applies to method"):
        SpeculativeConfig(method="ngram", draft_lm_head_quantization="int8")
    assert SpeculativeConfig(model="m", quantization="w4a8", draft_lm_head_quantization="int8") \
        .draft_lm_head_quantization == "int8"
