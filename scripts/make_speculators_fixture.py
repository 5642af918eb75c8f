"""Build tests/fixtures/speculators_eagle3/: a tiny EAGLE-3 speculator made by the speculators
library itself (vllm-project/speculators), for the tiny random Llama target it was made for, plus
the library's own draft logits on one sequence, so specdec's loader is checked against the
library's writer and forward rather than against specdec's own writer.

Run it in a venv that has speculators (it is not a specdec dependency), e.g.

    python -m venv /work/venvs/speculators && . /work/venvs/speculators/bin/activate
    pip install torch==2.13.0 && pip install --no-deps speculators && pip install \
        'transformers>=5,<=5.19' safetensors pydantic pydantic-settings loguru rich typer click tqdm \
        huggingface-hub protobuf psutil httpx openai aiohttp 'datasets>=4,<=5.1'
    python scripts/make_speculators_fixture.py [OUT]

(speculators declares torchvision / torchaudio but building and saving a speculator imports neither.)

Layout of OUT (default tests/fixtures/speculators_eagle3):
  target/     a 3-layer Llama (hidden 64, 2 query / 1 kv heads, vocab 256, char-level tokenizer), transformers save_pretrained
  eagle3/     the speculator, the library's save_pretrained (less the copy of the library's config.py
              it adds for trust_remote_code: that is the library's code, and nothing here reads it); its speculators_config.verifier.name_or_path
              is "../target": a path relative to the speculator folder (the script saves from there)
  reference.safetensors   tokens [S + 1] and the library's logits [ttt_steps, S, draft vocab] of
              Eagle3DraftModel.forward (teacher-forced TTT steps) on the target's auxiliary states
Weights are stored in bfloat16 to keep the fixture small; the reference is the saved folder as the
library loads it, in float32.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

SEED = 0
VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = 256, 64, 3, 2, 1, 64  # head_dim 32: vLLM's CPU attention has no 16
DRAFT_VOCAB, DRAFT_LAYERS, TTT_STEPS = 128, 2, 3
# non-default flags, so a loader that ignores what the library wrote shows it
FLAGS = dict(norm_before_residual=False, fc_norm=True, norm_output=True)


def char_tokenizer(out: Path):
    """A char-level tokenizer covering all VOCAB ids (3 specials + 253 characters)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<bos>": 0, "<eos>": 1, "<pad>": 2}
    chars = [chr(c) for c in range(32, 127)] + [chr(c) for c in range(0xC0, 0x250)]
    for c in chars[: VOCAB - len(vocab)]:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    fast.save_pretrained(out)
    return fast


def make_target(out: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = char_tokenizer(out)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.05,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # larger logits than the default init: varied greedy output
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    model.to(torch.bfloat16).save_pretrained(out)


def make_speculator(target_dir: Path, out: Path):
    """The library's own path (what its trainer does): the draft layer config from the verifier,
    vocab mappings from a token distribution, Eagle3DraftModel.from_training_args (it copies the
    verifier's embedding and, through t2d, its LM head rows), then random decoder weights."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    layer_config = create_transformer_layer_config(
        verifier_name_or_path=str(target_dir), num_layers=DRAFT_LAYERS, draft_arch="llama", hidden_act=None,
        sliding_window=0, full_attention_indices=list(range(DRAFT_LAYERS)))
    gen = torch.Generator().manual_seed(SEED + 1)
    freq = {i: int(c) for i, c in enumerate(torch.randint(1, 1000, (VOCAB,), generator=gen))}
    d2t, t2d = build_vocab_mappings_from_distribution(freq, DRAFT_VOCAB, VOCAB)
    cwd = os.getcwd()
    out.mkdir(parents=True, exist_ok=True)
    os.chdir(out)  # the verifier is recorded as "../target", relative to the speculator folder
    try:
        torch.manual_seed(SEED + 2)
        model = Eagle3DraftModel.from_training_args(
            verifier_config=layer_config, t2d=t2d, d2t=d2t, verifier_name_or_path="../target",
            draft_vocab_size=DRAFT_VOCAB, ttt_steps=TTT_STEPS, target_layer_ids=None,  # the library's default ids
            draft_attn_impl="eager", **FLAGS)
    finally:
        os.chdir(cwd)
    with torch.no_grad():  # a fresh head's drafts barely vary from row to row: larger weights, random norms
        for name, p in model.named_parameters():
            if name.startswith(("embed_tokens", "lm_head", "verifier_")):
                continue
            if p.dim() == 2:
                p.mul_(8.0)
            elif "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    return model.to(torch.bfloat16), d2t, t2d


@torch.no_grad()
def reference(head_dir: Path, target_dir: Path) -> dict[str, torch.Tensor]:
    """tokens [S + 1]; logits [TTT_STEPS, S, DRAFT_VOCAB]: the saved speculator as the library
    loads it (Eagle3DraftModel.from_pretrained, float32), its forward over the target's states at
    its aux layers (the input of layer i: transformers' hidden_states[i]), aligned as the library's
    shift_batch aligns them (row p: g_p with token p + 1)."""
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    cwd = os.getcwd()
    os.chdir(head_dir)  # the library resolves the verifier path from the working directory
    try:
        config = Eagle3SpeculatorConfig.from_pretrained(".")
        config.transformer_layer_config._attn_implementation = "eager"
        model = Eagle3DraftModel.from_pretrained(".", config=config, dtype=torch.float32).eval()
    finally:
        os.chdir(cwd)
    gen = torch.Generator().manual_seed(SEED + 3)
    tokens = torch.randint(3, VOCAB, (17,), generator=gen)
    states = target(tokens[None], output_hidden_states=True).hidden_states
    aux = torch.cat([states[i] for i in model.config.eagle_aux_hidden_state_layer_ids], dim=-1)
    seen = []
    hook = model.lm_head.register_forward_hook(lambda mod, inp, out: seen.append(out[0].float().clone()))
    try:
        model(hidden_states=aux[:, :-1], input_ids=tokens[None, 1:],
              document_ids=torch.zeros(1, len(tokens) - 1, dtype=torch.long), ttt_steps=TTT_STEPS)
    finally:
        hook.remove()
    return {"tokens": tokens, "logits": torch.stack(seen)}


def main() -> None:
    from safetensors.torch import save_file

    out = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "tests/fixtures/speculators_eagle3")
    target_dir, head_dir = out / "target", out / "eagle3"
    make_target(target_dir)
    model, d2t, t2d = make_speculator(target_dir, head_dir)
    model.save_pretrained(head_dir)
    ref = reference(head_dir, target_dir)
    (head_dir / "config.py").unlink(missing_ok=True)  # the library's own config source (for trust_remote_code): not kept
    save_file(ref, str(out / "reference.safetensors"), metadata={"format": "pt"})
    config = json.loads((head_dir / "config.json").read_text())
    from importlib.metadata import version

    print(f"speculators {version('speculators')}: wrote {out}")
    print(json.dumps({k: config.get(k) for k in ("draft_vocab_size", "eagle_aux_hidden_state_layer_ids",
                                                  "norm_before_residual", "norm_before_fc", "fc_norm",
                                                  "norm_output")}))
    print("draft vocab: target ids", (torch.arange(DRAFT_VOCAB) + d2t)[:8].tolist(), "...; t2d sum",
          int(t2d.sum()))
    for f in sorted(out.rglob("*")):
        if f.is_file():
            print(f"{f.stat().st_size:>8}  {f.relative_to(out)}")


if __name__ == "__main__":
    main()
