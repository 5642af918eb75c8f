"""Drafting right after verification (float32): the drafts a step proposes are the ones the
next step verifies (or a prefix of them when the token budget runs out, the rest dropped on
both sides), a new request drafts at the end of the step that computed its prompt, and greedy
output stays plain decoding's."""
from __future__ import annotations

from specdec import LLM, SamplingParams

ENGINE = dict(dtype="float32", device="cpu", max_model_len=128)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def run_recorded(llm: LLM, prompt: str):
    records = []
    llm.engine.add_step_observer(records.append)
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    llm.engine.remove_step_observer(records.append)
    return out, records


def test_next_step_verifies_exactly_the_proposed_drafts(llama_path, noisy_draft_path, prompts):
    want = LLM(model=llama_path, **ENGINE).generate([prompts[2]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(model=llama_path, **ENGINE, speculative_config={"method": "draft_model", "model": noisy_draft_path,
                                                              "num_speculative_tokens": 3})
    got, records = run_recorded(llm, prompts[2])
    assert got == want
    first = records[0]  # the prompt's step: no drafts verified, the first ones proposed
    assert first.result.num_draft_tokens == [0] and len(first.result.draft_token_ids[0]) == 3
    for prev, step in zip(records, records[1:]):
        assert step.scheduled.spec_token_ids[0] == prev.result.draft_token_ids[0]
        assert step.result.num_draft_tokens[0] == len(prev.result.draft_token_ids[0])
    assert sum(r.result.num_accepted_tokens[0] for r in records) > 0
    assert llm.engine.executor.driver_worker.num_request_states() == 0


def test_a_small_token_budget_verifies_a_prefix_of_the_drafts(llama_path, noisy_draft_path, prompts):
    want = LLM(model=llama_path, **ENGINE).generate([prompts[2]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    # 3 tokens a step: the newest token and 2 of the 3 drafts proposed
    llm = LLM(model=llama_path, **ENGINE, max_num_batched_tokens=3, enable_chunked_prefill=True,
              speculative_config={"method": "draft_model", "model": noisy_draft_path, "num_speculative_tokens": 3})
    got, records = run_recorded(llm, prompts[2])
    assert got == want
    cut = [(prev.result.draft_token_ids[0], step.scheduled.spec_token_ids[0]) for prev, step in zip(records, records[1:])
           if prev.result.draft_token_ids[0]]
    assert any(len(proposed) == 3 for proposed, _ in cut)
    assert all(scheduled == proposed[:2] for proposed, scheduled in cut)
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_blocks
