"""Rotary tables against transformers' own rope functions: YaRN (gpt-oss's truncate=False form,
the default form, DeepSeek's mscale ratio) and LongRoPE (short and long factors), attention
factor included."""
import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from specdec.layers.rotary import RotaryEmbedding

MAX_POSITION = 256


def hf_tables(config, rope_type: str, **kwargs):
    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **kwargs)
    freqs = torch.outer(torch.arange(MAX_POSITION).float(), inv_freq)
    return freqs.cos() * factor, freqs.sin() * factor, factor


@pytest.mark.parametrize("params", [
    dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=64,
         rope_theta=150000.0),
    dict(factor=4.0, original_max_position_embeddings=32, rope_theta=10000.0),
    dict(factor=4.0, mscale=1.0, mscale_all_dim=0.7, original_max_position_embeddings=32, rope_theta=10000.0),
], ids=["gpt_oss", "default", "mscale_ratio"])
def test_yarn_matches_transformers(params):
    config = LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=MAX_POSITION,
                         rope_parameters={"rope_type": "yarn", **params})
    cos, sin, factor = hf_tables(config, "yarn")
    ours = RotaryEmbedding(32, MAX_POSITION, params["rope_theta"], dict(config.rope_parameters))
    assert factor > 1.0
    torch.testing.assert_close(ours.cos, cos, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.sin, sin, rtol=1e-6, atol=1e-6)


def test_longrope_short_and_long_tables_match_transformers():
    short, long = [1.0 + 0.1 * i for i in range(8)], [2.0 + 0.5 * i for i in range(8)]
    config = Phi3Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=MAX_POSITION,
                        original_max_position_embeddings=32,
                        rope_scaling={"rope_type": "longrope", "short_factor": short, "long_factor": long})
    ours = RotaryEmbedding(16, MAX_POSITION, config.rope_parameters["rope_theta"], dict(config.rope_parameters))
    positions = torch.arange(MAX_POSITION)
    for seq_len, use_long in ((32, False), (33, True)):
        cos, sin, _ = hf_tables(config, "longrope", seq_len=seq_len)
        got_cos, got_sin = ours.lookup(positions, long_rows=torch.full((MAX_POSITION,), use_long))
        torch.testing.assert_close(got_cos[:, 0], cos, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got_sin[:, 0], sin, rtol=1e-6, atol=1e-6)
