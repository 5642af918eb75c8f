"""Roofline arithmetic: bytes per step, tied / gathered tensors, packed and int8 buffers."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from specdec.bench.roofline import (
    WeightBytes,
    kv_bytes_per_token,
    measure_bandwidth,
    paired_fraction,
    roofline,
    tensor_nbytes,
    weight_bytes,
)
from specdec.layers.quantization import Int8Linear, PackedLinear, _can_pack


class Toy(nn.Module):
    def __init__(self, vocab=100, hidden=16, tied=False, dtype=torch.float32):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden, dtype=dtype)
        self.proj = nn.Linear(hidden, 2 * hidden, bias=True, dtype=dtype)
        self.lm_head = nn.Linear(hidden, vocab, bias=False, dtype=dtype)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight


def test_roofline_tokens_per_s_is_bandwidth_over_bytes_per_step():
    weights = WeightBytes(total=1_100_000_000, read_per_step=1_000_000_000, gathered=100_000_000)
    r = roofline(bandwidth=20e9, weights=weights, kv_per_token=1000, mean_context_len=200, batch_size=1)
    assert r.bytes_per_step == 1_000_000_000 + 1000 * 200
    assert r.tokens_per_s == pytest.approx(20e9 / (1e9 + 2e5))
    assert r.fraction(r.tokens_per_s / 2) == pytest.approx(0.5)
    # batch B: weights once, KV per sequence, B tokens per step
    r8 = roofline(20e9, weights, 1000, 200, batch_size=8)
    assert r8.bytes_per_step == 1e9 + 8 * 1000 * 200
    assert r8.tokens_per_s == pytest.approx(8 * 20e9 / (1e9 + 1.6e6))
    assert r8.as_dict()["gb_per_step"] == pytest.approx(r8.bytes_per_step / 1e9)


def test_untied_embedding_is_a_gather_not_a_stream():
    m = Toy(tied=False)
    w = weight_bytes(m)
    emb, proj, head = 100 * 16 * 4, (16 * 32 + 32) * 4, 16 * 100 * 4
    assert w.total == emb + proj + head
    assert w.gathered == emb
    assert w.read_per_step == proj + head


def test_tied_embedding_counts_once_as_the_lm_head_read():
    m = Toy(tied=True)
    w = weight_bytes(m)
    matrix, proj = 100 * 16 * 4, (16 * 32 + 32) * 4
    assert w.total == matrix + proj
    assert w.read_per_step == matrix + proj
    assert w.gathered == 0


def test_int8_buffers_are_counted_at_their_real_size():
    m = Toy()
    m.proj = Int8Linear(m.proj)
    w = weight_bytes(m)
    int8_bytes = 32 * 16 * 1 + 32 * 4 + 32 * 4  # int8 weight, fp32 scales, bias
    assert w.read_per_step == int8_bytes + 16 * 100 * 4


@pytest.mark.skipif(not _can_pack(torch.bfloat16, torch.device("cpu")), reason="no oneDNN bf16 packing here")
def test_packed_bf16_weights_are_counted():
    m = Toy(dtype=torch.bfloat16)
    m.lm_head = PackedLinear(m.lm_head)
    assert m.lm_head.packed_weight.is_mkldnn  # opaque: no storage to ask, bytes from numel
    assert tensor_nbytes(m.lm_head.packed_weight) == 100 * 16 * 2
    w = weight_bytes(m)
    assert w.read_per_step == (16 * 32 + 32) * 2 + 100 * 16 * 2


def test_kv_bytes_per_token_gqa():
    cfg = SimpleNamespace(num_attention_heads=32, num_key_value_heads=4, hidden_size=2048, num_hidden_layers=22)
    # TinyLlama-1.1B in bf16: 22 layers x (K + V) x 4 heads x 64 dims x 2 bytes
    assert kv_bytes_per_token(cfg, torch.bfloat16) == 22 * 2 * 4 * 64 * 2


def test_measured_bandwidth_is_a_plausible_rate():
    bw = measure_bandwidth(num_bytes=8 << 20, repeats=2)
    assert math.isfinite(bw) and 1e8 < bw < 1e13


def test_paired_fraction_scales_the_roofline_with_each_repetitions_bandwidth():
    r = roofline(bandwidth=20e9, weights=WeightBytes(2_000_000_000, 2_000_000_000, 0), kv_per_token=0,
                 mean_context_len=0)
    assert r.tokens_per_s == pytest.approx(10.0)
    # a busy repetition: half the bandwidth and half the speed is still the same fraction
    assert paired_fraction([8.0, 4.0, 9.0], [20e9, 10e9, 20e9], r) == pytest.approx(0.8)


def test_compute_roof_takes_over_for_large_batches():
    weights = WeightBytes(total=2_000_000_000, read_per_step=2_000_000_000, gathered=0,
                          streamed_matrix_elements=1_000_000_000)
    # 2 GFLOP per token (+ attention 1e6 FLOPs per context token x 100) at 200 GFLOP/s: ~98 tokens/s
    small = roofline(20e9, weights, kv_per_token=0, mean_context_len=100, batch_size=1, flops_per_s=200e9,
                     attention_flops_per_context_token=1_000_000)
    assert small.flops_per_token == 2e9 + 1e8
    assert small.compute_tokens_per_s == pytest.approx(200e9 / 2.1e9)
    assert small.attainable_tokens_per_s == pytest.approx(10.0) and small.as_dict()["bound_by"] == "memory"
    big = roofline(20e9, weights, 0, 100, batch_size=32, flops_per_s=200e9, attention_flops_per_context_token=1_000_000)
    assert big.tokens_per_s == pytest.approx(320.0)
    assert big.attainable_tokens_per_s == pytest.approx(200e9 / 2.1e9) and big.as_dict()["bound_by"] == "compute"
    assert paired_fraction([47.6], [20e9], big, attainable=True) == pytest.approx(47.6 / (200e9 / 2.1e9))


def test_streamed_matrix_elements_count_matmul_weights_only():
    w = weight_bytes(Toy(tied=False))
    assert w.streamed_matrix_elements == 16 * 32 + 16 * 100  # proj and lm_head weights; no bias, no embedding
