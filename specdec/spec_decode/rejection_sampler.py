"""Lossless verification of draft tokens by modified rejection sampling.

Pure torch and vectorised over requests: this is the reference that faster kernels are
tested against, so it favours being obviously right over being clever.
"""
from __future__ import annotations

import torch

from specdec.layers.sampler import SamplingMetadata, processed_probs, sample_from_probs

PLACEHOLDER_TOKEN_ID = -1


def rejection_sample(
    target_logits: torch.Tensor,  # [num_rows, V] float32, penalties applied; request r owns num_draft_tokens[r] + 1 rows
    draft_token_ids: torch.Tensor,  # [num_draft_total] int64, requests concatenated
    num_draft_tokens: list[int],  # [R]; 0 => plain decoding of that request
    draft_probs: torch.Tensor | None,  # [num_draft_total, V] the q each draft was sampled from; None => one-hot q
    meta: SamplingMetadata,  # R rows
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify K_r draft tokens x_1..x_K per request against the target and emit 1..K_r+1 tokens.

    Speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via
    Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with
    Speculative Sampling"). Row i of a request's target logits gives p_i, the target's
    distribution for the token at draft position i (after the request's temperature / top-k /
    top-p / min-p), and q_i is the distribution the draft sampled x_i from.

    - accepted tokens: the longest prefix of drafts that passes the test. A random request
      accepts x_i with probability min(1, p_i(x_i) / q_i(x_i)); a greedy request accepts x_i
      iff x_i == argmax p_i.
    - recovered token: replaces the first rejected draft i. Random: drawn from the residual
      normalize(max(0, p_i - q_i)); greedy: argmax p_i. Nothing after it is emitted.
    - bonus token: emitted when all K drafts are accepted, drawn from p_{K+1} (greedy:
      argmax), the row the target scored after the last draft at no extra cost.

    Accepted-then-recovered/bonus tokens are distributed exactly as sampling from the target
    one token at a time; for greedy requests they equal greedy target decoding.

    Randomness of request r comes from meta.generators[r] when set, else the global RNG, in
    a fixed order: K_r uniforms, then V exponentials for its one recovered-or-bonus draw. So
    a seeded request's result does not depend on what else is in the batch.

    Returns output_token_ids [R, max_k + 1] int64 (padded with PLACEHOLDER_TOKEN_ID) and
    num_accepted [R] int64; request r emits output_token_ids[r, :num_accepted[r] + 1].
    """
    num_rows = sum(num_draft_tokens) + len(num_draft_tokens)
    if target_logits.shape[0] != num_rows or draft_token_ids.shape[0] != sum(num_draft_tokens):
        raise ValueError(
            f"rejection_sample: num_draft_tokens={num_draft_tokens} needs {num_rows} target rows and "
            f"{sum(num_draft_tokens)} draft tokens, got {target_logits.shape[0]} and {draft_token_ids.shape[0]}"
        )
    layout = _PaddedLayout(num_draft_tokens, target_logits.device)
    drafts = torch.where(layout.is_draft, draft_token_ids[layout.draft_index], PLACEHOLDER_TOKEN_ID)  # [R, K]

    if meta.all_greedy:  # fast path: argmax only, no V-sized softmax or sort
        num_accepted, final_tokens = _verify_greedy(target_logits, drafts, layout)
    elif meta.all_random:
        num_accepted, final_tokens = _verify_random(target_logits, drafts, draft_probs, layout, meta)
    else:
        greedy_accepted, greedy_final = _verify_greedy(target_logits, drafts, layout)
        random_accepted, random_final = _verify_random(target_logits, drafts, draft_probs, layout, meta)
        is_greedy = meta.temperature == 0  # [R]
        num_accepted = torch.where(is_greedy, greedy_accepted, random_accepted)
        final_tokens = torch.where(is_greedy, greedy_final, random_final)

    # Emit the accepted drafts, then the recovered/bonus token right after them.
    output = torch.where(layout.positions[:-1] < num_accepted[:, None], drafts, PLACEHOLDER_TOKEN_ID)
    placeholder_column = torch.full((len(num_draft_tokens), 1), PLACEHOLDER_TOKEN_ID, device=output.device)
    output = torch.cat([output, placeholder_column], dim=1)  # [R, K+1]
    output.scatter_(1, num_accepted[:, None], final_tokens[:, None])
    return output, num_accepted


class _PaddedLayout:
    """Index maps from the flat, ragged inputs to a padded [R, max_k (+1)] view."""

    def __init__(self, num_draft_tokens: list[int], device):
        self.num_draft_tokens = list(num_draft_tokens)  # host copy: loops over it never sync
        self.max_k = max(num_draft_tokens, default=0)
        self.num_drafts = torch.tensor(num_draft_tokens, dtype=torch.int64, device=device)  # [R]
        self.positions = torch.arange(self.max_k + 1, device=device)  # [K+1]
        num_rows = self.num_drafts + 1
        target_start = torch.cumsum(num_rows, 0) - num_rows  # [R]
        # Padding positions repeat the request's last row, so every index stays valid.
        self.target_rows = target_start[:, None] + torch.minimum(self.positions, self.num_drafts[:, None])  # [R, K+1]
        self.is_draft = self.positions[:-1] < self.num_drafts[:, None]  # [R, K]
        draft_start = torch.cumsum(self.num_drafts, 0) - self.num_drafts  # [R]
        self.draft_index = torch.where(self.is_draft, draft_start[:, None] + self.positions[:-1], 0)  # [R, K]


def _num_leading_true(mask: torch.Tensor) -> torch.Tensor:
    """[R, K] bool -> [R] int64: length of the all-True prefix of each row."""
    return mask.long().cumprod(dim=1).sum(dim=1)


def _verify_greedy(
    target_logits: torch.Tensor, drafts: torch.Tensor, layout: _PaddedLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    target_argmax = target_logits.argmax(dim=-1)[layout.target_rows]  # [R, K+1]
    num_accepted = _num_leading_true((drafts == target_argmax[:, :-1]) & layout.is_draft)  # [R]
    # At the first mismatch argmax is the recovered token; after K matches it is the bonus.
    final_tokens = target_argmax.gather(1, num_accepted[:, None]).squeeze(1)  # [R]
    return num_accepted, final_tokens


def _residual_probs(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """max(0, p - q), left unnormalised (the exponential race does not need it). q is zero
    for bonus rows, which leaves p. If rounding empties the residual (p == q up to float
    error, where a rejection has probability ~0), fall back to p."""
    residual = (target_probs - draft_probs).clamp_min_(0.0)  # [R, V]
    return torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, target_probs)


def _draft_uniforms(layout: _PaddedLayout, generators: list[torch.Generator | None], device) -> torch.Tensor:
    """[R, K] U[0,1); a seeded request draws exactly its own K_r from its generator."""
    uniforms = torch.empty(len(generators), layout.max_k, device=device)
    if any(g is None for g in generators):
        uniforms.uniform_()
    for request, (generator, k) in enumerate(zip(generators, layout.num_draft_tokens)):
        if generator is not None and k > 0:
            uniforms[request, :k] = torch.rand(k, generator=generator, device=device)
    return uniforms


def _verify_random(
    target_logits: torch.Tensor,
    drafts: torch.Tensor,  # [R, K]
    draft_probs: torch.Tensor | None,  # [num_draft_total, V]
    layout: _PaddedLayout,
    meta: SamplingMetadata,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_rows_per_request = [k + 1 for k in layout.num_draft_tokens]
    target_probs = processed_probs(target_logits, meta.expand(num_rows_per_request))  # [num_rows, V]
    draft_tokens = drafts.clamp_min(0)  # placeholders -> token 0; masked by is_draft below
    p_of_draft = target_probs[layout.target_rows[:, :-1], draft_tokens]  # [R, K]
    if draft_probs is None:
        q_of_draft = torch.ones_like(p_of_draft)
    else:
        q_of_draft = draft_probs[layout.draft_index, draft_tokens].float()  # [R, K]

    # u < p/q, written without the division: accepts with probability min(1, p/q), never when p = 0.
    uniforms = _draft_uniforms(layout, meta.generators, target_logits.device)
    accepted = (uniforms * q_of_draft < p_of_draft) & layout.is_draft  # [R, K]
    num_accepted = _num_leading_true(accepted)  # [R]

    # One V-sized draw per request, from the row at its first rejection (or its bonus row).
    final_rows = layout.target_rows.gather(1, num_accepted[:, None]).squeeze(1)  # [R]
    p_final = target_probs[final_rows]  # [R, V]
    rejected = (num_accepted < layout.num_drafts)[:, None]  # [R, 1]; False => bonus, q := 0
    q_final = torch.zeros_like(p_final)
    if layout.max_k > 0:
        rejected_position = num_accepted.clamp(max=layout.max_k - 1)[:, None]  # [R, 1]
        if draft_probs is None:
            q_final.scatter_(1, draft_tokens.gather(1, rejected_position), rejected.float())  # one-hot
        else:
            q_final = draft_probs[layout.draft_index.gather(1, rejected_position).squeeze(1)].float() * rejected
    final_tokens = sample_from_probs(_residual_probs(p_final, q_final), meta)  # [R]
    return num_accepted, final_tokens
