"""RuntimePlan: every runtime choice resolved from a config and the machine's facts, without loading
a model (the facts are given: the plan for a bf16 CPU, a CPU without bf16 or a GPU is checked here)."""
import dataclasses

import pytest
import torch
from transformers import AutoConfig

from specdec.config import EngineConfig, SpeculativeConfig
from specdec.worker.model_runner import ModelRunner
from specdec.worker.plan import Machine, blocks_per_sequence, num_kv_blocks, resolve_plan

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
BF16_CPU = dict(cpu_bf16=True, bf16_kernel_faster=True, rows_kernel=True)
PLAIN_CPU = dict(cpu_bf16=False, rows_kernel=True)
GPU = dict(cuda_bf16=True, triton=True, triton_sampler=True)


@pytest.fixture(scope="module")
def tiny():
    return AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, vocab_size=512)


def plan_for(tiny, tmp_path, device=CPU, facts=BF16_CPU, max_model_len=128, **cfg):
    config = EngineConfig(model=str(tmp_path), max_model_len=max_model_len, **cfg)
    return resolve_plan(config, str(tmp_path), tiny, max_model_len, Machine(device, **facts))


def test_auto_on_a_bf16_cpu_keeps_bf16_linears_and_computes_in_float32(tiny, tmp_path):
    plan = plan_for(tiny, tmp_path)
    assert plan.dtype == torch.float32 and plan.target.is_widened
    assert (plan.target.load_dtype, plan.target.quantization, plan.target.bf16_weights) == (torch.bfloat16, None, "exact")
    assert (plan.attention_backend, plan.sampler, plan.graphs) == ("rows", "torch", False)
    assert "linears bfloat16, other layers float32" in str(plan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.dtype = torch.bfloat16


def test_auto_on_a_bf16_cpu_stays_bf16_where_the_kernel_is_slower_or_the_float32_cache_does_not_fit(tiny, tmp_path):
    slower = plan_for(tiny, tmp_path, facts=dict(BF16_CPU, bf16_kernel_faster=False))
    assert slower.dtype == torch.bfloat16 and not slower.target.is_widened and slower.attention_backend == "torch"
    cfg = EngineConfig(model="unused", max_model_len=128)
    bf16_bytes = blocks_per_sequence(cfg, 128, 0) * ModelRunner.kv_bytes_per_block(tiny, cfg.block_size, torch.bfloat16)
    assert plan_for(tiny, tmp_path, kv_cache_memory=bf16_bytes).dtype == torch.bfloat16
    assert plan_for(tiny, tmp_path, kv_cache_memory=2 * bf16_bytes).dtype == torch.float32


def test_auto_on_a_cpu_without_bf16_is_float32_keeping_a_bf16_checkpoints_linears(tiny, tmp_path):
    plan = plan_for(tiny, tmp_path, facts=PLAIN_CPU)
    assert plan.dtype == torch.float32 and plan.target.load_dtype == torch.float32
    assert plan.target.bf16_weights == "exact" and plan.attention_backend == "rows"
    explicit = plan_for(tiny, tmp_path, facts=PLAIN_CPU, dtype="float32")
    assert explicit.target.bf16_weights is None  # an explicit dtype is what the user gets


@pytest.mark.parametrize("quantization, dtype, attention", [
    ("w8a8", torch.float32, "rows"),  # int8 activations: float32 and the rows kernel, even on a bf16 CPU
    ("w4a8", torch.float32, "rows"),
    ("int8", torch.bfloat16, "torch"),  # weight-only: the CPU's own dtype, never widened
])
def test_quantized_targets(tiny, tmp_path, quantization, dtype, attention):
    plan = plan_for(tiny, tmp_path, quantization=quantization)
    assert (plan.dtype, plan.attention_backend) == (dtype, attention)
    assert plan.target.quantization == quantization and not plan.target.is_widened
    assert f"linears {quantization}" in str(plan)


def test_a_gpu_plan_uses_triton_and_graphs_where_the_method_allows(tiny, tmp_path):
    plan = plan_for(tiny, tmp_path, CUDA, GPU, speculative_config=SpeculativeConfig(method="ngram"))
    assert (plan.dtype, plan.attention_backend, plan.sampler, plan.graphs) == (torch.bfloat16, "triton", "triton", True)
    assert plan.kv_budget_bytes is None and plan.graph_batch_sizes == (1, 2, 4, 8, 16, 32)
    assert plan.method == "ngram" and plan.draft is None and plan.max_spec_slots == 5
    eagle = SpeculativeConfig(method="eagle", model="head", num_speculative_tokens=3, dtype="float16")
    eager = plan_for(tiny, tmp_path, CUDA, GPU, speculative_config=eagle)
    assert not eager.graphs and eager.draft.compute_dtype == torch.float16  # the head's own dtype
    assert not plan_for(tiny, tmp_path, CUDA, GPU, enforce_eager=True).graphs
    assert plan_for(tiny, tmp_path, CUDA, dict(GPU, cuda_bf16=False)).dtype == torch.float16
    without_triton = dict(GPU, triton=False, triton_sampler=False)
    assert plan_for(tiny, tmp_path, CUDA, without_triton).attention_backend == "torch"
    with pytest.raises(ValueError, match="attention_backend='triton' needs triton"):
        plan_for(tiny, tmp_path, CUDA, without_triton, attention_backend="triton")


def test_the_kv_budget_on_cpu_and_the_plan_once_blocks_are_known(tiny, tmp_path):
    cfg = EngineConfig(model="unused", max_model_len=128, max_num_seqs=4)
    per_block = ModelRunner.kv_bytes_per_block(tiny, cfg.block_size, torch.float32)
    per_seq = blocks_per_sequence(cfg, 128, 5)
    assert per_seq == -(-(128 + 5 + 1) // 16)
    assert num_kv_blocks(cfg, CPU, per_block, 128, 5) == 4 * per_seq  # max_num_seqs sequences, under 2 GiB
    plan = plan_for(tiny, tmp_path, max_model_len=128).with_kv_blocks(4 * per_seq, per_block)
    assert f"KV cache: {4 * per_seq} blocks of 16 tokens" in str(plan)


def test_machine_facts_given_are_not_probed_and_unknown_facts_are_refused():
    assert Machine(CPU, cpu_bf16=False).default_dtype() == torch.float32
    assert Machine(CPU, cpu_bf16=True).resolve_dtype("float16") == torch.float16
    with pytest.raises(ValueError, match="unknown machine facts"):
        Machine(CPU, avx9=True)
