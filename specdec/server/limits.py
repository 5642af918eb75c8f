"""Per-request limits: each a server flag, each breach a 400 naming the field and the limit.

They bound the work one request can ask for before it costs anything: the body's bytes,
the messages to template, the completions and tokens to generate, the logprobs to rank,
the stop strings and ids checked on every token, and the schemas, regexes, grammars and tool
definitions that become grammars. ``SamplingParams`` bounds the values
themselves (finite, in range); these bound the amounts. request_models.py turns the ones a
JSON schema can state into constraints of the request models (and so of /openapi.json).
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


def check_limits(req: CompletionRequest | ChatCompletionRequest, limits: RequestLimits) -> None:
    """Raise the first breached limit that a JSON schema cannot state (request_models.py holds
    the rest): the size, as JSON text, of each output constraint and of all tools together."""
    sizes = constraint_sizes(req)
    if isinstance(req, ChatCompletionRequest) and req.tools:
        sizes.append(("tools", tools_size(req)))
    for field, size in sizes:
        if size > limits.max_schema_chars:
            raise APIError(400, f"{field} is {size} characters (as JSON), over this server's limit of "
                                f"{limits.max_schema_chars} (--max-schema-chars)", param=field, code="limit_exceeded")
