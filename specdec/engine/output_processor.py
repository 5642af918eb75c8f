"""Commit-time checks, token by token: EOS, stop token ids, stop strings, max_tokens.

A stop inside an accepted speculative run cuts the run there: ``append_token`` is called
once per emitted token and the caller stops at the first token that finishes the request.
Stop strings are matched on the detokenised text and, as in vLLM, removed from the output
text unless ``include_stop_str_in_output``; a match must end in text that a token past
``min_tokens`` added. A request stopped by EOS or a stop token id keeps that token in its
token ids but, as in vLLM, not in its text (unless ``include_stop_str_in_output``). While a
request with stop strings runs, its text holds back the last ``len(longest stop) - 1``
characters, so streamed text never has to be taken back.

Stop strings are matched incrementally: one compiled pattern of all of them (a lookahead,
so overlapping candidates are all tried; the longest wins at a position) scans, in one pass
in C, only the window a match ending in the new text can occupy: the new text plus
``len(longest stop) - 1`` characters before it. The earliest such match cuts the text, so
the cost per token does not grow with the output (the server bounds how many stops there are).

Running text is detokenised incrementally (``update_text``), as in TGI and vLLM: each call
decodes only the tokens since the last emitted piece plus the few before them as context
(a byte-level or SentencePiece token's text depends on its neighbours), and waits while the
text ends in an incomplete UTF-8 character; a full decode per token would make stop strings
and streaming O(length) per token. A finished request's text is still one full decode
(exactly ``tokenizer.decode``'s text), so only text seen while running can differ from it,
for tokenizers whose decode cleans up spaces across a window's edge; the server sends what
lies beyond in that case.
"""
from __future__ import annotations

import functools
import re

from specdec.engine.request import Request, RequestStatus


@functools.lru_cache(maxsize=1024)
def stop_pattern(stops: tuple[str, ...]) -> re.Pattern:
    """Matches, at each position, the longest stop string starting there (zero-width, so
    ``finditer`` visits every position and overlapping stops are not skipped)."""
    alternatives = "|".join(re.escape(s) for s in sorted(set(stops), key=len, reverse=True))
    return re.compile(f"(?=({alternatives}))", re.S)


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def decode(self, req: Request) -> str:
        return self.tokenizer.decode(req.output_token_ids, skip_special_tokens=req.sampling_params.skip_special_tokens)

    def update_text(self, req: Request) -> str:
        """``req.output_text`` extended to the tokens appended since the last call; returns it."""
        ids, skip = req.output_token_ids, req.sampling_params.skip_special_tokens
        if req.detok_read_offset >= len(ids):
            return req.output_text
        prefix, read = req.detok_prefix_offset, req.detok_read_offset
        known = self.tokenizer.decode(ids[prefix:read], skip_special_tokens=skip) if read > prefix else ""
        text = self.tokenizer.decode(ids[prefix:], skip_special_tokens=skip)
        if len(text) > len(known) and not text.endswith("\ufffd"):
            # (a window that decodes to less than its context, e.g. a special token skipped, waits)
            req.output_text += text[len(known):]
            req.detok_prefix_offset, req.detok_read_offset = read, len(ids)
        return req.output_text

    def running_text(self, req: Request) -> str:
        """A running request's text so far. With stop strings, vLLM's stop buffer: the tail that
        may still become a stop string is held back, so that streamed text only ever grows."""
        text, params = self.update_text(req), req.sampling_params
        if params.stop and not params.include_stop_str_in_output:
            return text[: max(0, len(text) - max(len(s) for s in params.stop) + 1)]
        return text

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
        new_from = len(req.output_text)  # where this token's text begins (the incremental text only grows)
        text = self.update_text(req)
        if not match or len(text) == new_from:
            return False
        longest = max(len(s) for s in params.stop)
        start = max(0, new_from - longest + 1)
        for m in stop_pattern(tuple(params.stop)).finditer(text, start):
            stop = m.group(1)
            if m.start() + len(stop) > new_from:  # the earliest match that ends in the new text
                end = m.start() + len(stop) if params.include_stop_str_in_output else m.start()
                req.output_text = text[:end]
                req.stop_reason = stop
                return True
        return False

    def final_text(self, req: Request) -> str:
        """A finished request's text: one full decode, cut as its stop requires (module docstring)."""
        params = req.sampling_params
        if isinstance(req.stop_reason, str):
            return req.output_text  # already cut at the stop string
        if req.status == RequestStatus.FINISHED_STOPPED and not params.include_stop_str_in_output:
            # stopped by EOS or a stop token id: the token is in token_ids, not in the text
            return self.tokenizer.decode(req.output_token_ids[:-1], skip_special_tokens=params.skip_special_tokens)
        return self.decode(req)
