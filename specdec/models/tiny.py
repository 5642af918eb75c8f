"""Tiny random checkpoints (any supported architecture) with a real byte-level BPE tokenizer.

Used by the tests (parity with transformers) and by ``specdec demo make-tiny DIR`` so a
fresh machine can run the engine without downloading anything.
"""
from __future__ import annotations

import inspect
from pathlib import Path

import torch

_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    # mixture-of-experts families: expert counts and sizes come as ``extra`` config fields
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
}


def _corpus() -> list[str]:
    import json
    import textwrap

    return [inspect.getsource(m) for m in (json.decoder, json.encoder, textwrap)]


def make_tokenizer(vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|bos|>", "<|eos|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>")
    fast.chat_template = (
        "{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|bos|>assistant: {% endif %}"
    )
    return fast


def make_tiny_model(
    out_dir: str | Path, arch: str = "llama", vocab_size: int = 320, hidden_size: int = 64, num_layers: int = 2,
    num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128, tie_word_embeddings: bool = False,
    max_position_embeddings: int = 1024, seed: int = 0, max_shard_size: str | None = None, tokenizer=None,
    random_norms_and_biases: bool = False, router_scale: float = 1.0, **extra,
) -> Path:
    """Write a random checkpoint. ``random_norms_and_biases`` replaces the ones/zeros that
    transformers initialises norms and biases with by random values, so parity tests notice a
    norm or bias that is loaded wrongly or not applied. ``router_scale`` multiplies the router
    matrices of mixture-of-experts layers, so that rows route to different experts."""
    import transformers

    if arch not in _ARCHS:
        raise ValueError(f"arch must be one of {sorted(_ARCHS)}, got {arch!r}")
    cfg_name, model_name = _ARCHS[arch]
    tokenizer = tokenizer or make_tokenizer(vocab_size)
    out = Path(out_dir)

    def build_config(vocab: int):
        return getattr(transformers, cfg_name)(
            vocab_size=vocab, hidden_size=hidden_size, intermediate_size=intermediate_size,
            num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
            max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, **extra,
        )

    # the architecture decides which tokenizer class AutoTokenizer builds (Qwen2's adds a
    # special token): size the vocabulary from the tokenizer as it will be loaded
    build_config(vocab_size).save_pretrained(out)
    tokenizer.save_pretrained(out)
    vocab_size = max(vocab_size, len(transformers.AutoTokenizer.from_pretrained(out)))
    config = build_config(vocab_size)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # larger logits than the default init, so sampling is not near-uniform
        model.lm_head.weight.mul_(8.0) if not tie_word_embeddings else model.model.embed_tokens.weight.mul_(4.0)
        for name, param in model.named_parameters():
            if name.endswith((".gate.weight", ".router.weight")) and param.dim() == 2:
                param.mul_(router_scale)
        if random_norms_and_biases:
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0.0, 0.1)
                elif "norm" in name:
                    param.copy_(1.0 + 0.3 * torch.randn_like(param))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    model.generation_config.save_pretrained(out)
    return out
