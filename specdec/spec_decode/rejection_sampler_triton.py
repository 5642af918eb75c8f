"""The Triton rejection sampler behind the reference's signature: the same inputs, the same random
draws in the same order, the same result as `rejection_sampler.rejection_sample`. This side owns
the layout (rows per request, the padded draft positions, the placeholder id) and the sampler's
probability processing; the kernel (`specdec.kernels.triton.rejection_sampler`) takes plain
tensors. Importing this module imports Triton."""
from __future__ import annotations

import torch

from specdec.kernels.triton.rejection_sampler import rejection_sample_core_triton
from specdec.layers.sampler import SamplingMetadata, processed_probs
from specdec.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID, _draft_uniforms, _PaddedLayout


def exponential_noise(num_reqs: int, vocab_size: int, generators: list[torch.Generator | None], device) -> torch.Tensor:
    """[R, V] Exp(1) draws exactly as `specdec.layers.sampler.sample_from_probs` makes them
    (global RNG for unseeded rows in one call, then each seeded row from its own generator,
    floored at the smallest normal float), so the kernel reproduces the reference's draw."""
    noise = torch.empty(num_reqs, vocab_size, dtype=torch.float32, device=device)
    if any(g is None for g in generators):
        noise.exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    return noise.clamp_min_(torch.finfo(torch.float32).tiny)


def rejection_sample_triton(
    target_logits: torch.Tensor,  # [num_rows, V] float32; request r owns num_draft_tokens[r] + 1 rows
    draft_token_ids: torch.Tensor,  # [num_draft_total] int64
    num_draft_tokens: list[int],  # [R]
    draft_probs: torch.Tensor | None,  # [num_draft_total, V] or None (one-hot q)
    meta: SamplingMetadata,  # R rows
) -> tuple[torch.Tensor, torch.Tensor]:  # output_token_ids [R, max_k + 1], num_accepted [R]
    """Drop-in for `rejection_sample`: same inputs, same random draws in the same order, same
    result. Probability processing (temperature, top-k, top-p, min-p) is the sampler's."""
    num_reqs = len(num_draft_tokens)
    num_rows = sum(num_draft_tokens) + num_reqs
    if target_logits.shape[0] != num_rows or draft_token_ids.shape[0] != sum(num_draft_tokens):
        raise ValueError(
            f"rejection_sample_triton: num_draft_tokens={num_draft_tokens} needs {num_rows} target rows and "
            f"{sum(num_draft_tokens)} draft tokens, got {target_logits.shape[0]} and {draft_token_ids.shape[0]}"
        )
    device = target_logits.device
    max_k = max(num_draft_tokens, default=0)
    counts = [0] + list(num_draft_tokens)
    cu_num_draft = torch.tensor(counts, dtype=torch.int64).cumsum_(0).to(device, non_blocking=True)
    target_argmax = None if meta.all_random else target_logits.argmax(dim=-1)
    target_probs = uniforms = noise = None
    if not meta.all_greedy:
        target_probs = processed_probs(target_logits, meta.expand([k + 1 for k in num_draft_tokens]))
        uniforms = _draft_uniforms(_PaddedLayout(num_draft_tokens, device), meta.generators, device)
        noise = exponential_noise(num_reqs, target_logits.shape[1], meta.generators, device)
    is_greedy = None if (meta.all_greedy or meta.all_random) else meta.temperature == 0
    assert PLACEHOLDER_TOKEN_ID == -1  # the kernel pads with -1
    return rejection_sample_core_triton(
        draft_token_ids, cu_num_draft, max_k, target_argmax=target_argmax, target_probs=target_probs,
        draft_probs=draft_probs, uniforms=uniforms, exponential_noise=noise, is_greedy=is_greedy,
    )
