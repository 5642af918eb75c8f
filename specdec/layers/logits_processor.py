"""Per-row logits processing that depends on a request's history: penalties and min_tokens.

Verification rows see history that includes the draft tokens before them: row i of a
request with drafts d_1..d_K scores position (num_output + i) after output + d_1..d_i.
"""
from __future__ import annotations

import torch

from specdec.engine.request import Request
from specdec.layers.sampler import SamplingMetadata, apply_penalties


def process_target_logits(
    logits: torch.Tensor,  # [num_rows, V] float32, rows = sum(len(drafts[r]) + 1)
    requests: list[Request],
    drafts: list[list[int]],
    meta_rows: SamplingMetadata,  # expanded to rows
) -> torch.Tensor:
    needs_min_tokens = any(r.sampling_params.min_tokens > r.num_output_tokens for r in requests)
    if meta_rows.no_penalties and not needs_min_tokens:
        return logits
    logits = logits.clone()  # the runner's output is an inference tensor; and logprobs stay raw, as in vLLM
    prompts, outputs = [], []
    row = 0
    for req, d in zip(requests, drafts):
        params = req.sampling_params
        for i in range(len(d) + 1):
            if not meta_rows.no_penalties:
                prompts.append(req.prompt_token_ids)
                outputs.append(req.output_token_ids + d[:i])
            if params.min_tokens > req.num_output_tokens + i:
                banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(req.eos_token_ids))
                banned = [t for t in banned if t < logits.shape[1]]
                if banned:
                    logits[row, banned] = float("-inf")
            row += 1
    if not meta_rows.no_penalties:
        logits = apply_penalties(logits, meta_rows, prompts, outputs)
    return logits
