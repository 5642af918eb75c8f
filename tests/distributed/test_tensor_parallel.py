"""Tensor parallelism on CPU over gloo, 2 ranks (float32): every output equals one device's.

Each TP engine spawns one extra process (rank 1); the driver is this process. Greedy outputs
must equal ``tensor_parallel_size=1`` token for token, plain and with every proposer, in mixed
batches with preemption; logprobs agree within 1e-5 relative; seeded sampling draws the same
tokens; a killed rank makes the engine raise and leaves no process behind.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.structured_output import StructuredOutputsParams

MAX_TOKENS = 16


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def reference(llama_path, prompts, one_device) -> dict[str, list[int]]:
    outs = one_device(llama_path).generate(prompts, greedy(), use_tqdm=False)
    return {p: o.outputs[0].token_ids for p, o in zip(prompts, outs)}


def assert_clean(llm: LLM) -> None:
    engine = llm.engine
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks and not engine.kv.req_blocks
    assert engine.executor.gather_rpc("num_request_states") == [0, 0]  # no rank keeps a finished request


def test_plain_decoding_and_logprobs_equal_one_device(llama_path, prompts, reference, tp, one_device):
    one = one_device(llama_path).generate(prompts[:6], greedy(logprobs=3), use_tqdm=False)
    llm = tp.engine(llama_path)
    worker = llm.engine.executor.driver_worker
    assert worker.runner.model.num_kv_heads == 1 and worker.runner.kv_caches[0].shape[3] == 1  # 2 KV heads / 2 ranks
    outs = llm.generate(prompts, greedy(logprobs=3), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [reference[p] for p in prompts]
    for a, b in zip(one, outs):
        for da, db in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert da.keys() == db.keys()
            for t in da:
                assert db[t] == pytest.approx(da[t], rel=1e-5, abs=1e-6)
    assert llm.get_metrics()["num_steps"] > 0
    assert_clean(llm)
    tp.stop(llm)


@pytest.mark.parametrize("draft_tp, tree", [(1, None), (2, {"tree_topk": 2, "tree_nodes": 6})],
                         ids=["draft-tp1-chain", "draft-tp2-tree"])
def test_draft_model_under_tp_is_greedy_identical_with_preemption(draft_tp, tree, llama_path, noisy_draft_path,
                                                                  prompts, reference, tp):
    spec = {"method": "draft_model", "model": noisy_draft_path, "num_speculative_tokens": 3,
            "draft_tensor_parallel_size": draft_tp, **(tree or {})}
    # a small cache: requests are preempted and recomputed
    llm = tp.engine(llama_path, spec, block_size=8, kv_cache_memory=40 * 2 * 8 * 2 * 2 * 16 * 4 * 2)
    outs = llm.generate(prompts[:12], greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [reference[p] for p in prompts[:12]]
    m = llm.get_metrics()
    assert m["num_draft_tokens"] > 0 and m["num_accepted_tokens"] > 0 and m["num_preemptions"] > 0
    assert_clean(llm)
    tp.stop(llm)


def test_ngram_and_seeded_sampling_under_tp(llama_path, prompts, reference, tp, one_device):
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=MAX_TOKENS, seed=100 + i, ignore_eos=True)
              for i in range(4)]
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    one_llm = one_device(llama_path, spec)
    one = one_llm.generate(prompts[:4], params, use_tqdm=False)
    llm = tp.engine(llama_path, spec)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [reference[p] for p in prompts]
    sampled = llm.generate(prompts[:4], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in sampled] == [o.outputs[0].token_ids for o in one]
    # structured output: every rank keeps its own matcher, in step
    grammar = StructuredOutputsParams(regex=r"(def|class) [a-z_]{1,12}\((x|y)?\):")
    constrained = [p.clone(structured_outputs=grammar, ignore_eos=False, max_tokens=40) for p in params]
    want = [o.outputs[0].token_ids for o in one_llm.generate(prompts[:4], constrained, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[:4], constrained, use_tqdm=False)] == want
    assert_clean(llm)
    tp.stop(llm)


@pytest.mark.parametrize("tree", [None, {"tree_topk": 2, "tree_nodes": 6}], ids=["chain", "tree"])
def test_eagle_under_tp_is_greedy_identical(tree, llama_path, prompts, reference, tmp_path_factory, tp):
    from specdec.models.eagle import init_head, save_head
    from specdec.models.loader import load_model

    head = init_head(load_model(llama_path, torch.float32, torch.device("cpu")), seed=1)
    folder = tmp_path_factory.mktemp("tp_eagle") / "head"
    save_head(head, folder)
    llm = tp.engine(llama_path, {"method": "eagle", "model": str(folder), "num_speculative_tokens": 3, **(tree or {})})
    outs = llm.generate(prompts[:8], greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [reference[p] for p in prompts[:8]]
    assert llm.get_metrics()["num_draft_tokens"] > 0
    assert_clean(llm)
    tp.stop(llm)


@pytest.mark.parametrize("tree", [None, {"tree_topk": 2, "tree_nodes": 6}], ids=["chain", "tree"])
def test_eagle3_under_tp_is_greedy_identical(tree, llama_path, prompts, reference, tmp_path_factory, tp):
    """Every rank's target exports the auxiliary layers' inputs (the full residual stream after the
    row-parallel all-reduces) to its own replicated EAGLE-3 head."""
    from specdec.models.loader import load_model
    from specdec.models.speculators import save_eagle3
    from specdec.training.train_eagle3 import init_eagle3

    head = init_eagle3(load_model(llama_path, torch.float32, torch.device("cpu")), (0, 1, 1), torch.arange(200), seed=1)
    folder = tmp_path_factory.mktemp("tp_eagle3") / "head"
    save_eagle3(head, folder, llama_path, ["LlamaForCausalLM"], 3, dtype=torch.float32)
    llm = tp.engine(llama_path, {"model": str(folder), **(tree or {})})
    outs = llm.generate(prompts[:8], greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [reference[p] for p in prompts[:8]]
    assert llm.get_metrics()["num_draft_tokens"] > 0
    assert_clean(llm)
    tp.stop(llm)


def test_a_killed_rank_makes_the_engine_raise_and_leaves_no_process(llama_path, prompts, tp):
    llm = tp.engine(llama_path)
    proc = llm.engine.executor._procs[0]
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1"):
        llm.generate(prompts[:2], greedy(), use_tqdm=False)
    assert time.monotonic() - started < 30
    assert not proc.is_alive()


def test_start_up_errors_name_the_limit(llama_path, make_model, tp, one_device):
    odd = make_model("tp_odd_heads", arch="llama", num_heads=3, num_kv_heads=1, hidden_size=48)
    with pytest.raises(ValueError, match="does not divide the model's attention heads"):
        tp.engine(odd)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        one_device(llama_path, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="draft_tensor_parallel_size must be 1 or tensor_parallel_size"):
        tp.engine(llama_path, {"method": "ngram", "draft_tensor_parallel_size": 3})


SCRIPT = """
import sys
from specdec import LLM, SamplingParams
from specdec.structured_output import StructuredOutputsParams
llm = LLM(model=sys.argv[1], tensor_parallel_size=2, dtype="float32", device="cpu", max_model_len=96)
out = llm.generate([sys.argv[2]], SamplingParams(temperature=0, max_tokens=int(sys.argv[3]), ignore_eos=True),
                   use_tqdm=False)
print("TOKENS", out[0].outputs[0].token_ids)
"""


def test_torchrun_two_nodes_on_loopback(llama_path, prompts, reference, tmp_path):
    """Two "nodes" of one rank each, started by torchrun on 127.0.0.1: every rank runs the same
    script; rank 0 drives and prints, rank 1 serves it and exits 0."""
    from specdec.executor.multiproc_executor import _free_port

    script = tmp_path / "run_tp.py"
    script.write_text(SCRIPT)
    port = _free_port()
    prompt = prompts[0]

    def node(rank: int) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
                str(script), llama_path, prompt, str(MAX_TOKENS)]

    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(node(r), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in (0, 1)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert f"TOKENS {reference[prompt]}" in outs[0][0]
    assert "TOKENS" not in outs[1][0]
