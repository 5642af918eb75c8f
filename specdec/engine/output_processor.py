"""Commit-time checks, token by token: EOS, stop token ids, stop strings, max_tokens.

A stop inside an accepted speculative run cuts the run there: ``append_token`` is called
once per emitted token and the caller stops at the first token that finishes the request.
Stop strings are matched on the detokenised text and, as in vLLM, removed from the output
text unless ``include_stop_str_in_output``; a match must end in text that a token past
``min_tokens`` added. A request stopped by EOS or a stop token id keeps that token in its
token ids but, as in vLLM, not in its text (unless ``include_stop_str_in_output``). While a
request with stop strings runs, its text holds back the last ``len(longest stop) - 1``
characters, so streamed text never has to be taken back.
"""
from __future__ import annotations

import os

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
        # the text is tracked from the first token, so text made before min_tokens never matches later
        if params.stop and self._check_stop_strings(req, match=n > params.min_tokens):
            return RequestStatus.FINISHED_STOPPED
        if n >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _check_stop_strings(self, req: Request, match: bool) -> bool:
        params = req.sampling_params
        previous, text = req.output_text, self.decode(req)
        req.output_text = text
        if not match:
            return False
        # where this token's text begins (a trailing partial UTF-8 character may have been rewritten)
        new_from = len(previous) if text.startswith(previous) else len(os.path.commonprefix([previous, text]))
        for stop in params.stop:
            idx = text.find(stop, max(0, new_from - len(stop) + 1))  # the match must end in the new text
            if idx >= 0:
                end = idx + len(stop) if params.include_stop_str_in_output else idx
                req.output_text = text[:end]
                req.stop_reason = stop
                return True
        return False

    def final_text(self, req: Request) -> str:
        params = req.sampling_params
        if isinstance(req.stop_reason, str):
            return req.output_text  # already cut at the stop string
        if req.status == RequestStatus.FINISHED_STOPPED and not params.include_stop_str_in_output:
            # stopped by EOS or a stop token id: the token is in token_ids, not in the text
            return self.tokenizer.decode(req.output_token_ids[:-1], skip_special_tokens=params.skip_special_tokens)
        if not req.is_finished and params.stop and not params.include_stop_str_in_output:
            # vLLM's stop buffer: hold back a tail that may still become a stop string, so that
            # streamed text only ever grows (output_text is current: it is updated every token)
            return req.output_text[: max(0, len(req.output_text) - max(len(s) for s in params.stop) + 1)]
        return self.decode(req)
