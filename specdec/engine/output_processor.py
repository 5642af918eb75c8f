"""Commit-time checks, token by token: EOS, stop token ids, stop strings, max_tokens.

A stop inside an accepted speculative run cuts the run there: ``append_token`` is called
once per emitted token and the caller stops at the first token that finishes the request.
Stop strings are matched on the detokenised text and, as in vLLM, removed from the output
text unless ``include_stop_str_in_output``.
"""
from __future__ import annotations

from specdec.engine.request import Request, RequestStatus


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def decode(self, req: Request) -> str:
        return self.tokenizer.decode(req.output_token_ids, skip_special_tokens=req.sampling_params.skip_special_tokens)

    def append_token(self, req: Request, token: int) -> RequestStatus | None:
        """Append one token; return the finishing status if this token ends the request."""
        params = req.sampling_params
        req.append_output_token(token)
        n = req.num_output_tokens
        if n >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                req.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if params.stop and self._check_stop_strings(req):
                return RequestStatus.FINISHED_STOPPED
        if n >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _check_stop_strings(self, req: Request) -> bool:
        params = req.sampling_params
        text = self.decode(req)
        tail_from = max(0, len(req.output_text) - max(len(s) for s in params.stop))
        req.output_text = text
        for stop in params.stop:
            idx = text.find(stop, tail_from)
            if idx >= 0:
                end = idx + len(stop) if params.include_stop_str_in_output else idx
                req.output_text = text[:end]
                req.stop_reason = stop
                return True
        return False

    def final_text(self, req: Request) -> str:
        if req.stop_reason is not None and isinstance(req.stop_reason, str):
            return req.output_text  # already cut at the stop string
        return self.decode(req)
