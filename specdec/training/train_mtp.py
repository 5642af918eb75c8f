"""Distil a DeepSeek-V3 multi-token-prediction (MTP) layer for its target, and a demo target to
train one for (``scripts/train_mtp_demo.py``).

The MTP layer (``spec_decode/mtp.py``): row p reads the target's final hidden state h_p and the
token t_{p+1}, ``x = eh_proj([enorm(embed(t_{p+1})), hnorm(h_p)])``, one DeepSeek decoder block,
``shared_head.norm`` and the target's LM head: the token at p + 2. It is trained, as
``train-draft`` trains an EAGLE head, on the target's own continuations: loss = KL(target's
next-token distribution at p + 1 || the layer's at row p). With ``unroll`` N, pass j = 2..N feeds
pass j-1's outputs back as the features (what drafting position j reads when the layer chains)
and is scored one token further, at weight 0.7^(j-1).

The layer is built from transformers' own ``DeepseekV3DecoderLayer`` (the oracle the head is
tested against) and saved as ``model.layers.{num_hidden_layers}.*`` beside the target's weights,
with ``num_nextn_predict_layers`` = 1, the layout DeepSeek-V3 checkpoints ship.

The demo target: random weights give near-uniform next-token distributions that nothing can
predict, so ``fit_lm_head`` first fits its LM head to Python sources on the frozen random
decoder (seconds of CPU, where training the whole target would take many minutes): its
continuations are then peaked and code-like, predictable as a small real model's are.
"""
from __future__ import annotations

import copy
import inspect
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

# Python modules whose sources are the demo target's training text (the stdlib: no download)
CORPUS_MODULES = ("json.decoder", "json.encoder", "textwrap", "string", "shlex", "fnmatch", "glob", "bisect",
                  "heapq", "base64", "csv", "calendar")


@dataclass(slots=True)
class DemoTargetShape:
    """A DeepSeek-V3 small enough for CPU training in minutes, large enough that one forward
    costs several MTP layers: MLA, a dense first layer, 4 routed experts (top-2) + 1 shared."""
    hidden_size: int = 512
    num_layers: int = 8
    num_heads: int = 8
    q_lora_rank: int = 192
    kv_lora_rank: int = 128
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 32
    v_head_dim: int = 32
    intermediate_size: int = 1536
    moe_intermediate_size: int = 768
    n_routed_experts: int = 4
    num_experts_per_tok: int = 2
    max_position_embeddings: int = 1024

    def config(self, tokenizer, num_mtp_layers: int = 1):
        from transformers import DeepseekV3Config

        return DeepseekV3Config(
            vocab_size=len(tokenizer), hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            moe_intermediate_size=self.moe_intermediate_size, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_heads,
            q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim,
            n_routed_experts=self.n_routed_experts, num_experts_per_tok=self.num_experts_per_tok,
            n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=1.0,
            max_position_embeddings=self.max_position_embeddings, tie_word_embeddings=False,
            num_nextn_predict_layers=num_mtp_layers, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )


def corpus_ids(tokenizer, modules: tuple[str, ...] = CORPUS_MODULES) -> torch.Tensor:  # [N] token ids
    import importlib

    text = "\n\n".join(inspect.getsource(importlib.import_module(m)) for m in modules)
    return torch.tensor(tokenizer.encode(text), dtype=torch.int64)


def _windows(ids: torch.Tensor, length: int, count: int, gen: torch.Generator) -> torch.Tensor:  # [count, length]
    starts = torch.randint(0, len(ids) - length, (count,), generator=gen)
    return torch.stack([ids[s:s + length] for s in starts.tolist()])


def _log(msg: str, progress: bool) -> None:
    if progress:
        print(msg, flush=True)


def fit_lm_head(model, ids: torch.Tensor, steps: int = 300, num_windows: int = 24, seq_len: int = 256,
                lr: float = 1e-2, seed: int = 0, progress: bool = True) -> list[float]:
    """Fit the LM head (only) to next-token cross-entropy on windows of ``ids``, the decoder's
    random features frozen: one forward caches them, so this costs seconds, and the target
    becomes a peaked language model of the corpus (a random-feature LM); the losses."""
    gen = torch.Generator().manual_seed(seed)
    batch = _windows(ids, seq_len + 1, num_windows, gen)
    with torch.no_grad():
        features = model.model(batch[:, :-1]).last_hidden_state.flatten(0, 1).float()  # [N, H], after the norm
    labels = batch[:, 1:].flatten()
    head = model.lm_head.weight
    head.requires_grad_(True)
    opt = torch.optim.AdamW([head], lr=lr, weight_decay=0.1)
    losses = []
    for step in range(steps):
        loss = F.cross_entropy(features @ head.t(), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            _log(f"lm head step {step:4d}  loss {loss.item():.3f}", progress)
    head.requires_grad_(False)
    return losses


@torch.no_grad()
def self_continuations(model, ids: torch.Tensor, num_sequences: int, prompt_len: int = 16, new_tokens: int = 96,
                       seed: int = 0) -> torch.Tensor:  # [num_sequences, prompt_len + new_tokens]
    """The target's own continuations of corpus windows: half greedy, half sampled at T = 0.7
    (what it emits when drafted for, greedy and sampled)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = _windows(ids, prompt_len, num_sequences, gen)
    torch.manual_seed(seed)
    half = num_sequences // 2
    outs = []
    for part, sample in ((prompts[:half], False), (prompts[half:], True)):
        kwargs = dict(do_sample=True, temperature=0.7, top_k=0) if sample else dict(do_sample=False)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model.generate(part, attention_mask=torch.ones_like(part), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, pad_token_id=model.config.pad_token_id, **kwargs)
        outs.append(out[:, :prompt_len + new_tokens])
    return torch.cat(outs)


@torch.no_grad()
def teacher_states(model, seqs: torch.Tensor, batch_size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """(final hidden states after the final norm [N, T, H], next-token log-probs [N, T, V]), float32."""
    hidden, logp = [], []
    for i in range(0, len(seqs), batch_size):
        out = model(seqs[i:i + batch_size], output_hidden_states=True)
        hidden.append(out.hidden_states[-1].float())
        logp.append(torch.log_softmax(out.logits.float(), dim=-1))
    return torch.cat(hidden), torch.cat(logp)


class MTPLayer(nn.Module):
    """A trainable MTP layer on a frozen transformers DeepSeek-V3 target (whose embedding, rotary
    and LM head it reads, not owns): forward(h [B, T, H], next ids [B, T]) -> (state [B, T, H],
    logits [B, T, V]); the state is what a chained pass reads as its features."""

    def __init__(self, target):
        super().__init__()
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

        config = target.config
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm, self.hnorm = DeepseekV3RMSNorm(hidden, eps), DeepseekV3RMSNorm(hidden, eps)
        # initially the next token's embedding plus a little of h: the target's last block on it
        # then guesses the token after, a start better than random
        eh = torch.cat([torch.eye(hidden), 0.1 * torch.eye(hidden)], dim=1)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.eh_proj.weight.data.copy_(eh)
        self.block = copy.deepcopy(target.model.layers[-1])
        self.block.self_attn.layer_idx = config.num_hidden_layers
        self.shared_head_norm = copy.deepcopy(target.model.norm)
        self.target = [target]  # a list: frozen, not a submodule

    def forward(self, features: torch.Tensor, next_ids: torch.Tensor, start: int = 0):
        target = self.target[0]
        num_rows = next_ids.shape[1]
        x = self.eh_proj(torch.cat([self.enorm(target.model.embed_tokens(next_ids)), self.hnorm(features)], dim=-1))
        positions = torch.arange(start, start + num_rows).unsqueeze(0).expand(next_ids.shape[0], -1)
        rope = target.model.rotary_emb(x, positions)
        mask = torch.full((num_rows, num_rows), float("-inf"), device=x.device).triu(1)[None, None].to(x.dtype)
        out = self.block(x, attention_mask=mask, position_embeddings=rope)
        out = out[0] if isinstance(out, tuple) else out
        return out, target.lm_head(self.shared_head_norm(out))

    def state_dict_for_checkpoint(self, layer_index: int) -> dict[str, torch.Tensor]:
        """The layer's weights under DeepSeek-V3's checkpoint names (``model.layers.{L}.*``),
        routed experts unstacked into ``mlp.experts.{e}.{gate,up,down}_proj``."""
        prefix = f"model.layers.{layer_index}."
        target = self.target[0]
        out = {f"{prefix}enorm.weight": self.enorm.weight, f"{prefix}hnorm.weight": self.hnorm.weight,
               f"{prefix}eh_proj.weight": self.eh_proj.weight,
               f"{prefix}shared_head.norm.weight": self.shared_head_norm.weight,
               f"{prefix}embed_tokens.weight": target.model.embed_tokens.weight,
               f"{prefix}shared_head.head.weight": target.lm_head.weight}
        for name, tensor in self.block.state_dict().items():
            if name == "mlp.experts.gate_up_proj":  # [E, 2I, H]
                for e, w in enumerate(tensor):
                    gate, up = w.chunk(2, dim=0)
                    out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = gate
                    out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = up
            elif name == "mlp.experts.down_proj":  # [E, H, I]
                for e, w in enumerate(tensor):
                    out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = w
            else:
                out[prefix + name] = tensor
        return {k: v.detach().float().contiguous().clone() for k, v in out.items()}


def mtp_loss(layer: MTPLayer, hidden: torch.Tensor, ids: torch.Tensor, teacher_logp: torch.Tensor,
             unroll: int = 1) -> torch.Tensor:
    """Sum over passes j = 1..unroll of 0.7^(j-1) KL(target || layer): pass 1's row p reads
    (h_p, t_{p+1}); pass j's reads (pass j-1's state at p - 1, t_{p+1}); both against the
    target's distribution at p + 1. hidden [B, T, H], ids [B, T], teacher_logp [B, T, V]."""
    total, features = hidden.new_zeros(()), hidden[:, :-1]
    for j in range(1, unroll + 1):
        tokens, teacher = ids[:, j:], teacher_logp[:, j:]
        if tokens.shape[1] == 0:
            break
        with torch.autocast("cpu", dtype=torch.bfloat16):
            state, logits = layer(features, tokens, start=j - 1)
        kl = F.kl_div(torch.log_softmax(logits.float(), dim=-1), teacher, log_target=True, reduction="none")
        total = total + 0.7 ** (j - 1) * kl.sum(-1).mean()
        features = state[:, :-1].float()
    return total


@torch.no_grad()
def top1_agreement(layer: MTPLayer, hidden: torch.Tensor, ids: torch.Tensor, teacher_logp: torch.Tensor) -> float:
    """How often pass 1's argmax equals the target's (the first draft's greedy acceptance rate)."""
    _, logits = layer(hidden[:, :-1], ids[:, 1:])
    return (logits.argmax(-1) == teacher_logp[:, 1:].argmax(-1)).float().mean().item()


def train_mtp(layer: MTPLayer, hidden: torch.Tensor, ids: torch.Tensor, teacher_logp: torch.Tensor, steps: int,
              batch_size: int = 16, lr: float = 1e-3, unroll: int = 3, seed: int = 0,
              progress: bool = True) -> list[float]:
    """AdamW on ``mtp_loss`` over random batches of the teacher's sequences; the losses."""
    gen = torch.Generator().manual_seed(seed)
    params = [p for p in layer.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    layer.train()
    losses = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 10)
        rows = torch.randint(0, len(ids), (min(batch_size, len(ids)),), generator=gen)
        loss = mtp_loss(layer, hidden[rows], ids[rows], teacher_logp[rows], unroll)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 20 == 0 or step == steps - 1:
            _log(f"mtp step {step:4d}  loss {loss.item():.3f}", progress)
    layer.eval()
    return losses


def save_target_with_mtp(target, layer: MTPLayer, tokenizer, out: str | Path) -> Path:
    """The target's Hugging Face folder with the MTP layer at model.layers.{num_hidden_layers}."""
    from safetensors.torch import load_file, save_file

    out = Path(out)
    target.config.num_nextn_predict_layers = 1
    target.save_pretrained(out)
    tokenizer.save_pretrained(out)
    target.generation_config.save_pretrained(out)
    file = out / "model.safetensors"
    weights = load_file(str(file))
    weights.update(layer.state_dict_for_checkpoint(target.config.num_hidden_layers))
    save_file(weights, str(file), metadata={"format": "pt"})
    return out


def build_demo_target(shape: DemoTargetShape, tokenizer, seed: int = 0, residual_scale: float = 0.05):
    """A random transformers DeepSeek-V3 of ``shape`` (float32, eval mode) whose blocks' outputs
    (``o_proj``, the experts' ``down_proj``) are scaled by ``residual_scale``: the residual stream
    stays close to the token's embedding plus a context term, so the fitted LM head is a smooth
    n-gram-like model rather than a hash of the whole context that nothing could learn."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(shape.config(tokenizer)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")):
                param.mul_(residual_scale)
    return model


def train_demo(out: str, shape: DemoTargetShape | None = None, head_steps: int = 300, mtp_steps: int = 80,
               num_sequences: int = 32, new_tokens: int = 64, unroll: int = 3, residual_scale: float = 0.05,
               seed: int = 0, progress: bool = True) -> dict:
    """Build the demo target, fit its LM head, distil its MTP layer, save both to ``out``; the stats."""
    from specdec.models.tiny import make_tokenizer

    started = time.perf_counter()
    tokenizer = make_tokenizer()
    shape = shape or DemoTargetShape()
    target = build_demo_target(shape, tokenizer, seed, residual_scale)
    ids = corpus_ids(tokenizer)
    target.requires_grad_(False)
    target_losses = fit_lm_head(target, ids, head_steps, seed=seed, progress=progress)
    t_target = time.perf_counter()
    seqs = self_continuations(target, ids, num_sequences, new_tokens=new_tokens, seed=seed + 1)
    held_out = self_continuations(target, ids, 8, new_tokens=new_tokens, seed=seed + 2)
    hidden, logp = teacher_states(target, seqs)
    held_hidden, held_logp = teacher_states(target, held_out)
    t_data = time.perf_counter()
    layer = MTPLayer(target)
    before = top1_agreement(layer, held_hidden, held_out, held_logp)
    mtp_losses = train_mtp(layer, hidden, seqs, logp, mtp_steps, unroll=unroll, seed=seed, progress=progress)
    after = top1_agreement(layer, held_hidden, held_out, held_logp)
    save_target_with_mtp(target, layer, tokenizer, out)
    stats = {"target_loss": [target_losses[0], target_losses[-1]], "mtp_loss": [mtp_losses[0], mtp_losses[-1]],
             "held_out_top1_agreement": [before, after], "target_s": t_target - started,
             "data_s": t_data - t_target, "mtp_s": time.perf_counter() - t_data}
    _log(f"saved {out}: {stats}", progress)
    return stats
