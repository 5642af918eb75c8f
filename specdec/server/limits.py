"""Per-request limits: each a server flag, each breach a 400 naming the field and the limit.

They bound the work one request can ask for before it costs anything: the body's bytes,
the messages to template, the completions and tokens to generate, the logprobs to rank,
the stop strings and ids checked on every token, and the schemas, regexes, grammars and tool
definitions that become grammars. ``SamplingParams`` bounds the values
themselves (finite, in range); these bound the amounts.
"""
from __future__ import annotations

from dataclasses import dataclass

from specdec.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from specdec.server.structured import constraint_sizes
from specdec.server.tools import tools_size


@dataclass
class RequestLimits:
    max_body_bytes: int = 4 << 20  # a full 128k-token context as text or token ids fits
    body_timeout: float = 30.0  # seconds for the body to arrive after the headers
    max_messages: int = 512
    max_n: int = 16
    max_tokens: int | None = None  # None: the model's context
    max_logprobs: int = 20
    max_stop: int = 16
    max_stop_length: int = 256  # characters per stop string
    max_stop_token_ids: int = 64
    max_schema_chars: int = 64 << 10  # each schema / regex / grammar, and all tool definitions together

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_messages", "max_n", "max_stop", "max_stop_length", "max_schema_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("max_logprobs", "max_stop_token_ids"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.body_timeout <= 0:
            raise ValueError(f"--body-timeout must be > 0, got {self.body_timeout}")


def _over(field: str, value: int, limit: int, flag: str) -> APIError:
    return APIError(400, f"{field} is {value}, over this server's limit of {limit} (--{flag})", param=field,
                    code="limit_exceeded")


def check_limits(req: CompletionRequest | ChatCompletionRequest, limits: RequestLimits, max_model_len: int,
                 vocab_size: int) -> None:
    """Raise the first breached limit as a 400, before any tokenizing or templating."""
    if req.n > limits.max_n:
        raise _over("n", req.n, limits.max_n, "max-n")
    max_tokens_limit = limits.max_tokens or max_model_len
    for name in ("max_tokens", "max_completion_tokens", "min_tokens"):
        value = getattr(req, name, None)
        if isinstance(value, int) and value > max_tokens_limit:
            flag = "max-tokens-limit" if limits.max_tokens else "max-model-len"
            raise _over(name, value, max_tokens_limit, flag)
    logprobs_field = "top_logprobs" if isinstance(req, ChatCompletionRequest) else "logprobs"
    num_logprobs = getattr(req, logprobs_field)
    if isinstance(num_logprobs, int) and num_logprobs > limits.max_logprobs:
        raise _over(logprobs_field, num_logprobs, limits.max_logprobs, "max-logprobs")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > limits.max_stop:
        raise APIError(400, f"stop has {len(stops)} strings, over this server's limit of {limits.max_stop} "
                            "(--max-stop)", param="stop", code="limit_exceeded")
    for s in stops:
        if len(s) > limits.max_stop_length:
            raise APIError(400, f"a stop string is {len(s)} characters, over this server's limit of "
                                f"{limits.max_stop_length} (--max-stop-length)", param="stop", code="limit_exceeded")
    ids = req.stop_token_ids or []
    if len(ids) > limits.max_stop_token_ids:
        raise APIError(400, f"stop_token_ids has {len(ids)} ids, over this server's limit of "
                            f"{limits.max_stop_token_ids} (--max-stop-token-ids)", param="stop_token_ids",
                       code="limit_exceeded")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"stop_token_ids holds {bad[0]}, outside the vocabulary [0, {vocab_size})",
                       param="stop_token_ids")
    if isinstance(req, ChatCompletionRequest) and len(req.messages) > limits.max_messages:
        raise APIError(400, f"messages has {len(req.messages)} entries, over this server's limit of "
                            f"{limits.max_messages} (--max-messages)", param="messages", code="limit_exceeded")
    sizes = constraint_sizes(req)
    if isinstance(req, ChatCompletionRequest) and req.tools:
        sizes.append(("tools", tools_size(req)))
    for field, size in sizes:
        if size > limits.max_schema_chars:
            raise APIError(400, f"{field} is {size} characters (as JSON), over this server's limit of "
                                f"{limits.max_schema_chars} (--max-schema-chars)", param=field, code="limit_exceeded")
