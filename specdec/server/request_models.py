"""The request models one server validates with: protocol.py's, with this server's limits
as schema constraints.

``request_models(limits, max_model_len, vocab_size)`` subclasses ``CompletionRequest`` and
``ChatCompletionRequest`` with every bound a JSON schema can state (``n``, ``max_tokens``,
``logprobs``, stop strings and ids, messages, prompt token ids and their vocabulary), so the
Preparer rejects with the same models that /openapi.json publishes; ``limit_flags`` names the
flag behind each bound for the error message. What a schema cannot state stays in
limits.py (the size of a JSON schema or grammar as text, prompts x n against capacity).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from pydantic import Field, create_model

from specdec.server.limits import RequestLimits
from specdec.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest

MAX_LOGPROBS = 20  # SamplingParams' bound, whatever --max-logprobs says


@dataclass(frozen=True)
class RequestModels:
    completion: type[CompletionRequest]
    chat: type[ChatCompletionRequest]


def request_models(limits: RequestLimits, max_model_len: int, vocab_size: int) -> RequestModels:
    max_tokens = limits.max_tokens or max_model_len
    tokens_flag = "--max-tokens-limit" if limits.max_tokens else "--max-model-len"
    stop_str = Annotated[str, Field(min_length=1, max_length=limits.max_stop_length)]
    stop = (stop_str | Annotated[list[stop_str], Field(max_length=limits.max_stop)] | None, None)
    token_id = Annotated[int, Field(ge=0, lt=vocab_size)]
    prompt_ids = Annotated[list[token_id], Field(min_length=1, max_length=max(1, max_model_len - 1))]
    max_tokens_field = (int | None, Field(None, ge=1, le=max_tokens))
    common = dict(
        n=(int, Field(1, ge=1, le=limits.max_n)),
        stop=stop,
        stop_token_ids=(Annotated[list[token_id], Field(max_length=limits.max_stop_token_ids)] | None, None),
        min_tokens=(int, Field(0, ge=0, le=max_tokens)),
    )
    logprobs_le = min(limits.max_logprobs, MAX_LOGPROBS)
    vocabulary = f"outside the vocabulary [0, {vocab_size})"
    flags = {
        "n": {"less_than_equal": "--max-n"},
        "max_tokens": {"less_than_equal": tokens_flag}, "max_completion_tokens": {"less_than_equal": tokens_flag},
        "min_tokens": {"less_than_equal": tokens_flag},
        "stop": {"too_long": "--max-stop", "string_too_long": "--max-stop-length"},
        "stop_token_ids": {"too_long": "--max-stop-token-ids", "less_than": vocabulary},
        "prompt": {"less_than": vocabulary, "too_long": f"longer than the model's context (max_model_len {max_model_len})"},
        "messages": {"too_long": "--max-messages"},
    }
    completion = create_model(
        "CompletionRequest", __base__=CompletionRequest, **common,
        prompt=(str | Annotated[list[str], Field(min_length=1)] | prompt_ids
                | Annotated[list[prompt_ids], Field(min_length=1)], ...),
        max_tokens=(int | None, Field(16, ge=1, le=max_tokens)),
        logprobs=(int | None, Field(None, ge=0, le=logprobs_le)),
        best_of=(int | None, Field(None, ge=1, le=limits.max_n)),
    )
    chat = create_model(
        "ChatCompletionRequest", __base__=ChatCompletionRequest, **common,
        messages=(list[ChatMessage], Field(min_length=1, max_length=limits.max_messages)),
        max_tokens=max_tokens_field, max_completion_tokens=max_tokens_field,
        top_logprobs=(int | None, Field(None, ge=0, le=logprobs_le)),
    )
    for model, logprobs_field in ((completion, "logprobs"), (chat, "top_logprobs")):
        model.limit_flags = {**flags, logprobs_field: {"less_than_equal": "--max-logprobs"}}
    return RequestModels(completion, chat)

