"""Per-row logits processing that depends on a request's history: penalties and min_tokens.

Verification rows see history that includes the draft tokens before them: row i of a
request with drafts d_1..d_K scores position (num_output + i) after output + d_1..d_i (in a
token tree, after the node's ancestors: ``DraftProposal.row_histories``).
"""
from __future__ import annotations

import torch

from specdec.engine.request import Request
from specdec.layers.sampler import SamplingMetadata, apply_penalties


def process_target_logits(
    logits: torch.Tensor,  # [num_rows, V] float32, rows = sum(len(drafts[r]) + 1)
    requests: list[Request],
    histories: list[list[list[int]]],  # per request, per row: the draft tokens before the position it scores
    meta_rows: SamplingMetadata,  # expanded to rows
) -> torch.Tensor:
    needs_min_tokens = any(r.sampling_params.min_tokens > r.num_output_tokens for r in requests)
    if meta_rows.no_penalties and not needs_min_tokens:
        return logits
    logits = logits.clone()  # the runner's output is an inference tensor; and logprobs stay raw, as in vLLM
    prompts, outputs = [], []
    row = 0
    for req, rows in zip(requests, histories):
        params = req.sampling_params
        for before in rows:
            if not meta_rows.no_penalties:
                prompts.append(req.prompt_token_ids)
                outputs.append(req.output_token_ids + before)
            if params.min_tokens > req.num_output_tokens + len(before):
                banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(req.eos_token_ids))
                banned = [t for t in banned if t < logits.shape[1]]
                if banned:
                    logits[row, banned] = float("-inf")
            row += 1
    if not meta_rows.no_penalties:
        logits = apply_penalties(logits, meta_rows, prompts, outputs)
    return logits
