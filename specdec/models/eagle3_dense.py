"""Dense (no KV cache) runs of an EAGLE-3 head over whole sequences: training-time test, and the
reference the paged head and the engine's drafts are checked against.

``DenseSteps`` runs step j = 0, 1, ... over every row of [B, S] sequences at once. Row i of step 0
reads (g_i, token i + 1) at position i and attends causally to step 0's rows 0..i; row i of step
j >= 1 sits at position i + j, reads the head's own step-(j-1) output of row i, and attends to step
0's rows 0..i and to its own row of steps 1..j: exactly what the engine's chain drafting from
num_computed_tokens = i + 1 attends to (the real tokens' head KV, then its earlier drafts).
"""
from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from specdec.layers.attention import AttentionBackend


class DenseSteps:
    def __init__(self, head, batch_size: int, seq_len: int):
        self.head, self.b, self.s = head, batch_size, seq_len
        self.caches: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in head.layers]  # per layer, per step

    @property
    def num_steps(self) -> int:
        return len(self.caches[0])

    def step(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """input_ids [B, S] (row i: the token at i + 1 + j), hidden [B, S, H] (step 0: g; then the
        last step's output) -> this step's output [B, S, H]."""
        b, s = self.b, self.s
        positions = (torch.arange(s, device=input_ids.device) + self.num_steps).repeat(b)
        with _dense_attention(self.head, b, s):
            out = self.head(input_ids.reshape(-1), positions, self.caches, SimpleNamespace(slot_mapping=None),
                            features=hidden.reshape(b * s, -1))
        return out.view(b, s, -1)


@contextmanager
def _dense_attention(head, b: int, s: int):
    """Swap every layer's paged attention for the dense step rule above (``kv_cache`` is the layer's
    list of earlier steps' K/V)."""
    def write(k, v, cache, slots):
        cache.append((k.view(b, s, *k.shape[1:]), v.view(b, s, *v.shape[1:])))

    def attend(q, cache, meta, scale):
        heads = q.shape[1]

        def spread(x):  # [B, S, Hkv, D] -> [B, heads, S, D]
            return x.transpose(1, 2).repeat_interleave(heads // x.shape[2], dim=1)

        qh = q.view(b, s, heads, -1).transpose(1, 2)                       # [B, h, S, D]
        k0, v0 = spread(cache[0][0]), spread(cache[0][1])
        if len(cache) == 1:
            out = F.scaled_dot_product_attention(qh, k0, v0, is_causal=True, scale=scale)
        else:
            causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
            scores = (qh @ k0.transpose(-1, -2)).float().mul(scale).masked_fill(~causal, float("-inf"))
            kd = torch.stack([spread(k) for k, _ in cache[1:]], dim=-2)    # [B, h, S, j, D]
            vd = torch.stack([spread(v) for _, v in cache[1:]], dim=-2)
            diag = (qh.unsqueeze(-2) * kd).sum(-1).float() * scale         # [B, h, S, j]
            p = torch.cat([scores, diag], dim=-1).softmax(-1).to(qh.dtype)
            out = p[..., :s] @ v0 + (p[..., s:].unsqueeze(-1) * vd).sum(-2)
        return out.transpose(1, 2).reshape(b * s, heads, -1)

    attns = [layer.self_attn for layer in head.layers]
    saved = [a.backend for a in attns]
    for a in attns:
        a.backend = AttentionBackend("dense_steps", write, attend)
    try:
        yield
    finally:
        for a, backend in zip(attns, saved):
            a.backend = backend


@torch.inference_mode()
def dense_drafts(head, tokens: torch.Tensor, aux: torch.Tensor, k: int) -> torch.Tensor:
    """Greedy chains from every prefix at once. tokens [L]; aux [L, n * H_t] the target's exported
    states -> [L - 1, k]: row c - 1 holds the k drafts the engine proposes at num_computed_tokens = c
    (the head read g_0..g_{c-1} with tokens 1..c, then its own outputs with its own drafts)."""
    steps = DenseSteps(head, 1, len(tokens) - 1)
    out = steps.step(tokens[None, 1:], head.combine(aux[None, :-1]))
    drafts = []
    for j in range(k):
        tok = head.compute_logits(out[0]).argmax(-1)                       # [L - 1]
        drafts.append(tok)
        if j + 1 < k:
            out = steps.step(tok[None], out)
    return torch.stack(drafts, dim=1)


def hf_aux_states(hf_model, input_ids: torch.Tensor, layer_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' forward -> (its logits [B, T, V], the states a specdec target exports for an
    EAGLE-3 head [B, T, n * H]: Hugging Face hidden_states[L] is the input of layer L)."""
    out = hf_model(input_ids, output_hidden_states=True)
    return out.logits, torch.cat([out.hidden_states[i] for i in layer_ids], dim=-1)
