"""OpenAI request bodies (pydantic, strict types) and the error shape every failure uses.

Request models turn themselves into ``SamplingParams``; any ``ValueError`` on the way
becomes an ``APIError`` (HTTP 400) whose ``param`` names the field as the client spelled it.
The output-constraint fields (``response_format``, vLLM's ``structured_outputs`` and
``guided_*``) are typed here and mapped in structured.py; ``tools`` / ``tool_choice`` in tools.py.
"""
from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specdec.sampling_params import (
    MAX_INT32,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
    SamplingParams,
)
from specdec.structured_output import StructuredOutputsParams

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
                499: "invalid_request_error", 503: "service_unavailable_error", 500: "internal_server_error"}
# pydantic error types that mean "over a bound": with the bound's flag they are a limit_exceeded
_BOUND_ERRORS = ("less_than", "less_than_equal", "greater_than", "greater_than_equal", "too_long", "too_short",
                 "string_too_long", "string_too_short")
CHAT_ROLES = ("system", "user", "assistant", "tool")  # what chat templates render; others can forge turns


class APIError(Exception):
    """An error a client can see: HTTP status + OpenAI's ``{"error": {...}}`` body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        # OpenAI's code is a string or null, never the status
        return {"error": {"message": self.message, "type": _ERROR_TYPES.get(self.status, "api_error"),
                          "param": self.param, "code": self.code}}


def validation_error(e: ValidationError, limit_flags: dict[str, dict[str, str]] | None = None) -> APIError:
    """The first pydantic error, as a 400 naming the field path (``messages.0.content``).
    ``limit_flags[field][error type]`` names the server flag (or fact) behind a bound, so a
    breach says which flag to change (``code: limit_exceeded`` when it is a flag)."""
    errors = e.errors(include_url=False)
    # a union reports every member's error: the one over a bound is the member the value was meant for
    err = next((x for x in errors if x["type"] in _BOUND_ERRORS), errors[0])
    loc = ".".join(str(p) for p in err["loc"] if not _is_union_tag(p))
    received = f" (got {_short(err['input'])})" if "input" in err and not isinstance(err["input"], (dict, list)) else ""
    if isinstance(err.get("input"), list) and err["type"] in ("too_long", "too_short"):
        received = f" (got {len(err['input'])} items)"
    hint = None
    if err["type"] in _BOUND_ERRORS and err["loc"]:
        hint = (limit_flags or {}).get(str(err["loc"][0]), {}).get(err["type"])
    if hint is None:
        return APIError(400, f"invalid value for '{loc}': {err['msg']}{received}", param=loc or None)
    is_flag = hint.startswith("--")
    reason = f"over this server's limit ({hint})" if is_flag else hint
    return APIError(400, f"invalid value for '{loc}': {err['msg']}{received}: {reason}", param=str(err["loc"][0]),
                    code="limit_exceeded" if is_flag else None)


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def _is_union_tag(part) -> bool:  # pydantic names union members in loc: "list[int]", "function-after[...]"
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool")
                                      or part.startswith("constrained-"))


class _Strict(BaseModel):
    # strict: "5" is not an int and true is not a number; unknown fields are ignored as OpenAI does
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaSpec(_Strict):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class _SamplingFields(_Strict):
    """Fields shared by both endpoints; None means "the default"."""
    model: str | None = None
    n: int = 1
    # value ranges are SamplingParams' (sampling_params.py), stated here so the schema shows them
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM-compatible extensions
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32)  # -1 or 0: off
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    min_tokens: int = Field(0, ge=0, le=MAX_INT32)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False  # each choice (and stream delta) also carries the generated token ids
    # specdec extension: decode this request without speculation (same batch)
    use_speculation: bool = True
    # output constraints (at most one; structured.py): OpenAI's, then vLLM's current and older names
    response_format: ResponseFormat | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _check_unsupported(self) -> None:
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")

    def _sampling_kwargs(self, structured_outputs: StructuredOutputsParams | None) -> dict[str, Any]:
        kw: dict[str, Any] = dict(structured_outputs=structured_outputs,
            n=self.n, seed=self.seed, stop=self.stop, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
            stop_token_ids=self.stop_token_ids, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, use_speculation=self.use_speculation,
        )
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        return kw


def make_sampling_params(kw: dict[str, Any], rename: dict[str, str] | None = None) -> SamplingParams:
    """``SamplingParams(**kw)``; its ValueError ("SamplingParams.top_p must be ...") becomes a 400
    whose param is the request's own spelling of the field."""
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        match = re.match(r"SamplingParams\.(\w+) (.*)", str(e), re.S)
        if not match:
            raise APIError(400, str(e)) from None
        field = (rename or {}).get(match.group(1), match.group(1))
        raise APIError(400, f"{field} {match.group(2)}", param=field) from None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def to_sampling_params(self, structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        self._check_unsupported()
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, f"best_of must equal n ({self.n}) when given, got {self.best_of}", param="best_of")
        if self.echo and self.logprobs is not None:
            raise APIError(400, "echo with logprobs (prompt logprobs) is not supported", param="echo")
        kw = {**self._sampling_kwargs(structured_outputs), "max_tokens": self.max_tokens, "logprobs": self.logprobs}
        return make_sampling_params(kw)

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class AssistantToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")  # name, reasoning ... pass to the template
    role: Literal[CHAT_ROLES]
    content: str | list[TextPart] | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def as_template_dict(self) -> dict:
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            out["content"] = "".join(part.text for part in self.content)
        return out


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's names (and dots, for namespaces)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema; None: no parameters
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list | None = None  # legacy function calling
    function_call: Any = None
    add_generation_prompt: bool = True

    def to_sampling_params(self, structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        self._check_unsupported()
        for legacy in ("functions", "function_call"):
            if getattr(self, legacy) is not None:
                raise APIError(400, f"{legacy} (legacy function calling) is not supported; use tools",
                               param=legacy)
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
        max_field = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        kw = {**self._sampling_kwargs(structured_outputs), "max_tokens": max_tokens, "logprobs": logprobs}
        return make_sampling_params(kw, rename={"max_tokens": max_field, "logprobs": "top_logprobs"})

    def template_messages(self) -> list[dict]:
        """The messages as chat templates read them: text parts joined, and an assistant's tool
        call arguments as objects (templates write them with ``tojson``), not JSON strings."""
        out = []
        for i, m in enumerate(self.messages):
            d = m.as_template_dict()
            for j, call in enumerate(d.get("tool_calls") or []):
                param = f"messages.{i}.tool_calls.{j}.function.arguments"
                try:
                    args = json.loads(call["function"]["arguments"])
                except ValueError:
                    raise APIError(400, f"{param} is not JSON", param=param) from None
                if not isinstance(args, dict):
                    raise APIError(400, f"{param} must be a JSON object, got {type(args).__name__}", param=param)
                call["function"]["arguments"] = args
            out.append(d)
        return out
