"""The public controls benchmarks use: a speculation policy swapped on one engine, the batch
limit, proposer controls through the executor, one copy of the target for several engines."""
import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.spec_decode.controller import SpecController
from specdec.worker.shared_weights import SharedWeights

ENGINE = dict(dtype="float32", device="cpu", max_model_len=128, spec_cost_calibration=False)
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def greedy(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


def drafts_per_step(llm):
    seen = []
    llm.engine.add_step_observer(lambda record: seen.extend(record.result.num_draft_tokens))
    return seen


def test_a_fixed_policy_on_an_auto_engine_drafts_k_and_teaches_auto_nothing(llama_path, prompts):
    llm = LLM(model=llama_path, **ENGINE, speculative_config={
        "method": "ngram", "num_speculative_tokens": "auto", "max_num_speculative_tokens": 4})
    seen = drafts_per_step(llm)
    auto = llm.engine.set_speculation_policy(SpecController.fixed(2))
    assert auto.adaptive
    greedy(llm, prompts[:4])
    assert max(seen) == 2 and auto.acceptance.num_pooled_trials == 0
    assert llm.engine.set_speculation_policy(auto).max_k == 2
    greedy(llm, prompts[:4])
    assert llm.engine.spec_controller is auto
    with pytest.raises(ValueError, match=r"may plan 0..4 drafts per request .* got 5"):
        llm.engine.set_speculation_policy(SpecController.fixed(5))


def test_max_num_seqs_is_a_public_setting_within_the_configured_one(llama_path, prompts):
    llm = LLM(model=llama_path, **ENGINE, max_num_seqs=4)
    batch_sizes = []
    llm.engine.add_step_observer(lambda record: batch_sizes.append(len(record.scheduled.request_ids)))
    llm.engine.set_max_num_seqs(1)
    greedy(llm, prompts[:3])
    assert max(batch_sizes) == 1
    for bad in (0, 5, 2.0):
        with pytest.raises(ValueError, match="max_num_seqs must be in 1..4"):
            llm.engine.set_max_num_seqs(bad)


def test_proposer_controls_go_through_the_executor(llama_path, prompts):
    suffix = LLM(model=llama_path, **ENGINE, speculative_config={"method": "suffix", "num_speculative_tokens": 3})
    greedy(suffix, prompts[:2])
    suffix.engine.executor.control_proposer("reset_history")
    with pytest.raises(ValueError, match="has no proposer control 'set_acceptance'"):
        suffix.engine.executor.control_proposer("set_acceptance", 0.5)
    with pytest.raises(ValueError, match="no speculative_config"):
        LLM(model=llama_path, **ENGINE).engine.executor.control_proposer("reset_history")


def test_engines_given_one_shared_weights_run_on_one_copy(llama_path, prompts):
    weights = SharedWeights()
    plain = LLM(model=llama_path, **ENGINE, target_weights=weights)
    ngram = LLM(model=llama_path, **ENGINE, target_weights=weights,
                speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    model = weights.model
    assert plain.apply_model(lambda m: m) == [model] and ngram.apply_model(lambda m: m) == [model]
    assert greedy(ngram, prompts[:4]) == greedy(plain, prompts[:4])
    with pytest.raises(ValueError, match="target_weights holds weights loaded as"):
        LLM(model=llama_path, **{**ENGINE, "dtype": "bfloat16"}, target_weights=weights)
    assert ngram.engine.runtime_plan.dtype == torch.float32 and "runtime plan" in str(ngram.engine.runtime_plan)
