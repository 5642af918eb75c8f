"""The cost model's timed forwards route like real rows on a mixture-of-experts target: a probe of
K+1 rows reads the union of the experts its distinct tokens choose, not one row's top-k."""
from __future__ import annotations

from specdec import LLM
from specdec.layers.moe import moe_layers
from specdec.worker.calibrate import probe_tokens, time_forward, time_verify_forward, verification_batch_sizes


def test_verification_probe_reads_the_union_of_the_rows_experts(make_model):
    path = make_model("qwen3_moe_calibrate", arch="qwen3_moe", num_layers=1, num_experts=16, num_experts_per_tok=2,
                      moe_intermediate_size=32, initializer_range=0.05, router_scale=20.0)
    llm = LLM(model=path, dtype="float32", device="cpu", max_model_len=128)
    runner = llm.engine.executor.driver_worker.runner
    (moe,) = moe_layers(runner.model)
    moe.stats.recording = True
    time_verify_forward(runner, num_reqs=1, query_len=1, context=16, repeats=1)
    one_row = max(moe.stats.history)
    moe.stats.reset()
    time_verify_forward(runner, num_reqs=1, query_len=8, context=16, repeats=1)
    assert one_row == 2 and min(moe.stats.history) >= 6  # 8 rows x top-2 of 16: most of the union
    moe.stats.reset()
    time_forward(runner, 8, repeats=1)
    assert min(moe.stats.history) >= 6
    tokens = probe_tokens(runner, [8, 8])
    assert len(set(tokens[0])) >= 6 and tokens == probe_tokens(runner, [8, 8])  # varied, and the same on every rank


def test_auto_on_a_moe_target_prices_every_batch_by_rows_shape(make_model, llama_path):
    path = make_model("qwen3_moe_calibrate", arch="qwen3_moe", num_layers=1, num_experts=16, num_experts_per_tok=2,
                      moe_intermediate_size=32, initializer_range=0.05, router_scale=20.0)
    spec = {"method": "ngram", "num_speculative_tokens": "auto", "max_num_speculative_tokens": 3}
    llm = LLM(model=path, dtype="float32", device="cpu", max_model_len=128, max_num_seqs=4, speculative_config=spec)
    runner = llm.engine.executor.driver_worker.runner
    assert verification_batch_sizes(runner, max_num_seqs=4, max_rows=4) == (1, 2, 4)
    assert verification_batch_sizes(runner, max_num_seqs=64, max_rows=4) == (1, 2, 4, 8)
    knots = set(llm.engine.spec_controller.cost.token_counts.tolist())
    assert {b * q for b in (1, 2, 4) for q in (1, 2, 3, 4)} <= knots  # (1..4 requests) x (K + 1 = 1..4 rows)
    assert llm.engine.spec_controller.cost.cost("target", 3) > 0.0
    # a dense target: one request's 1..K + 1 rows (a kernel may change with the rows), no batch shapes
    dense = LLM(model=llama_path, dtype="float32", device="cpu", max_model_len=128, speculative_config=spec)
    assert verification_batch_sizes(dense.engine.executor.driver_worker.runner, 64, 4) == ()
    dense_knots = set(dense.engine.spec_controller.cost.token_counts.tolist())
    assert {1, 2, 3, 4} <= dense_knots and 12 not in dense_knots
