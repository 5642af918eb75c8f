"""Engine outputs -> OpenAI JSON: per-choice stream deltas, logprobs in both formats, usage.

Engine outputs are cumulative; ``ChoiceDelta`` remembers what a choice already sent and
returns only the new part. While a choice is running it holds back text that may still
change: a trailing U+FFFD (an incomplete UTF-8 sequence the next token may complete) and,
when stop strings are set, the last ``max(len(stop)) - 1`` characters (the start of a
stop string that the engine will cut). So the streamed deltas concatenate to exactly the
final text that a non-streamed request returns.

Logprobs are finite: a token a grammar masks (or any non-finite value) is reported as
``LOGPROB_FLOOR``, OpenAI's value for "probability zero", since ``-Infinity`` is not JSON.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from specdec.outputs import CompletionOutput, RequestOutput, SpecDecodeStats


LOGPROB_FLOOR = -9999.0


def finite_logprob(value: float | None) -> float | None:
    """``value`` floored at ``LOGPROB_FLOOR``; NaN and -inf become the floor (None stays None)."""
    if value is None:
        return None
    return value if math.isfinite(value) and value > LOGPROB_FLOOR else LOGPROB_FLOOR


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: int | str | None

    @property
    def is_empty(self) -> bool:
        return not self.text and not self.token_ids and self.finish_reason is None


@dataclass
class ChoiceDelta:
    holdback: int = 0  # characters a stop string could still claim
    sent_text: str = ""
    num_sent_tokens: int = 0
    finished: bool = False

    def advance(self, c: CompletionOutput) -> Delta:
        text = c.text
        if c.finish_reason is None:
            text = text[: max(0, len(text) - self.holdback)]
            text = text.rstrip("\ufffd")
        # a text that changed under us (detokenizer cleanup) cannot be retracted: send what lies beyond
        delta = text[len(self.sent_text):] if len(text) > len(self.sent_text) else ""
        if len(text) > len(self.sent_text):
            self.sent_text = text
        new_ids = c.token_ids[self.num_sent_tokens:]
        new_logprobs = c.logprobs[self.num_sent_tokens:] if c.logprobs is not None else None
        self.num_sent_tokens = len(c.token_ids)
        finish = None
        if c.finish_reason is not None and not self.finished:
            self.finished = True
            finish = c.finish_reason
        return Delta(delta, new_ids, new_logprobs, finish, c.stop_reason if finish else None)


def holdback_for(stop: list[str]) -> int:
    return max((len(s) for s in stop), default=1) - 1


@dataclass
class TokenText:
    """Token id -> its text, cached (the front end's own tokenizer: event-loop thread only)."""
    tokenizer: object
    cache: dict[int, str] = field(default_factory=dict)

    def __call__(self, token_id: int) -> str:
        s = self.cache.get(token_id)
        if s is None:
            s = self.cache[token_id] = self.tokenizer.decode([token_id])
        return s


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, float]], top: int,
                        token_text: TokenText, offset: int) -> dict:
    """The legacy /v1/completions shape: parallel lists + text offsets."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for tid, lp in zip(token_ids, logprobs):
        s = token_text(tid)
        tokens.append(s)
        token_logprobs.append(finite_logprob(lp.get(tid)))
        if top:  # distinct ids may share a text (e.g. partial UTF-8 -> U+FFFD): keep the likelier
            entries: dict[str, float] = {}
            for t, v in _top(lp, top):
                entries.setdefault(token_text(t), v)
            tops.append(entries)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops if top else None,
            "text_offset": offsets}


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, float]], top: int, token_text: TokenText) -> dict:
    def entry(tid: int, value: float) -> dict:
        s = token_text(tid)
        return {"token": s, "logprob": finite_logprob(value), "bytes": list(s.encode("utf-8"))}

    content = []
    for tid, lp in zip(token_ids, logprobs):
        item = entry(tid, lp.get(tid))
        item["top_logprobs"] = [entry(t, v) for t, v in _top(lp, top)]
        content.append(item)
    return {"content": content}


def _top(lp: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The ``k`` likeliest, floored (NaN sorts as the floor, never first)."""
    return sorted(((t, finite_logprob(v)) for t, v in lp.items()), key=lambda kv: kv[1], reverse=True)[:k]


def usage(outputs: list[RequestOutput | None], num_prompt_tokens: int) -> dict:
    """OpenAI usage, plus the requests' speculative-decoding statistics as ``spec_decode``."""
    completion_tokens = 0
    stats = SpecDecodeStats()
    for out in outputs:
        if out is None:
            continue
        completion_tokens += sum(len(c.token_ids) for c in out.outputs)
        if out.metrics is not None:
            s = out.metrics.spec_decode
            stats.num_drafts += s.num_drafts
            stats.num_draft_tokens += s.num_draft_tokens
            stats.num_accepted_tokens += s.num_accepted_tokens
    return {
        "prompt_tokens": num_prompt_tokens, "completion_tokens": completion_tokens,
        "total_tokens": num_prompt_tokens + completion_tokens,
        "spec_decode": {
            "num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens, "acceptance_rate": round(stats.acceptance_rate, 4),
            "mean_acceptance_length": round(stats.mean_acceptance_length, 4),
        },
    }
