"""Preparer: a raw body -> a validated request, its SamplingParams and its prompt token ids.

Runs on a TokenizerPool thread (``fn(tokenizer, body)``), cheapest check first: strict JSON,
the model name, the server's limits, the sampling values, the prompts x n capacity, a text's
length against the context (each token spans at most ``max_token_chars`` characters, so a
longer text cannot fit and is never tokenized), then the template and the tokenizer. The
output constraint (structured.py) and the tools (tools.py) are resolved with the sampling
values, so their errors are 400s before admission too.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from specdec.lora.request import LoRARequest
from specdec.sampling_params import SamplingParams
from specdec.server.lora_models import LoRAModels
from specdec.server.limits import RequestLimits, check_limits
from specdec.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from specdec.server.request_body import parse_request
from specdec.server.request_models import RequestModels, request_models
from specdec.server.structured import engine_error_param, request_constraint
from specdec.structured_output import StructuredOutputsParams
from specdec.server.tools import NO_TOOLS, ToolPlan, plan_tools
from specdec.tool_parsers import ToolParser


@dataclass
class Prepared:
    req: CompletionRequest | ChatCompletionRequest
    model: str
    params: SamplingParams
    prompt_ids: list[list[int]]
    prompt_texts: list[str | None]
    constraint_field: str | None = None  # the request field the output constraint came from
    tool_parser: ToolParser | None = None  # reads the output's tool calls (chat with tools)
    lora_request: LoRARequest | None = None  # the adapter ``model`` names (None: the base model)


def max_token_chars(tokenizer) -> int:
    """The most characters one token's text can have (its vocabulary string bounds its decoding)."""
    try:
        return max(1, max(len(t) for t in tokenizer.get_vocab()))
    except Exception:  # noqa: BLE001 - no bound known: never skip tokenizing on length
        return 1 << 30


@dataclass
class Preparer:
    limits: RequestLimits
    model_names: list[str]
    max_model_len: int
    vocab_size: int
    capacity: int  # admission capacity, in sequences
    max_token_chars: int
    validate_prompt: Callable[[list[int]], None]  # EngineCore.validate_prompt: reads immutable fields only
    # EngineCore.compile_grammar (thread-safe, cached): a grammar that does not compile is a 400 here
    compile_grammar: Callable[[StructuredOutputsParams], object]
    tool_parser: ToolParser | None = None  # the model's tool-call format (--tool-call-parser or its template)
    lora_models: LoRAModels | None = None  # the adapters served as models of their own (--enable-lora)
    # what bodies are validated with, and /openapi.json publishes: the limits as schema constraints
    models: RequestModels = field(init=False)

    def __post_init__(self) -> None:
        self.models = request_models(self.limits, self.max_model_len, self.vocab_size)

    def check_model(self, name: str | None) -> str:
        if name is not None and name not in self.model_names:
            if self.lora_models is not None and self.lora_models.lookup(name) is not None:
                return name
            served = self.model_names + (self.lora_models.names() if self.lora_models is not None else [])
            raise APIError(404, f"the model '{name[:200]}' does not exist; this server serves {served}",
                           param="model", code="model_not_found")
        return self.model_names[0]

    def _lora(self, model: str) -> LoRARequest | None:
        return self.lora_models.lookup(model) if self.lora_models is not None else None

    def _common(self, req, num_prompts: int) -> tuple[str, SamplingParams, str | None, ToolPlan]:
        model = self.check_model(req.model)
        check_limits(req, self.limits)
        tools = plan_tools(req, self.tool_parser) if isinstance(req, ChatCompletionRequest) else NO_TOOLS
        constraint, field = request_constraint(req)
        if tools.constraint is not None:
            if constraint is not None:
                raise APIError(400, f"tool_choice {_describe(req.tool_choice)} is enforced by a grammar, so it "
                                    f"cannot be combined with {field}", param="tool_choice")
            constraint, field = tools.constraint, "tool_choice"
        params = req.to_sampling_params(constraint)
        if params.max_tokens is None and self.limits.max_tokens:  # "up to the context" within the limit too
            params.max_tokens = self.limits.max_tokens
        if constraint is not None:
            try:
                self.compile_grammar(constraint)
            except ValueError as e:
                param = engine_error_param(str(e), field)
                raise APIError(400, f"{param}: {str(e).split(': ', 1)[-1]}", param=param) from None
        if num_prompts * params.n > self.capacity:
            raise APIError(400, f"the request needs {num_prompts * params.n} sequences (prompts x n), more than "
                                f"this server's capacity of {self.capacity}", param="n")
        return model, params, field, tools

    def _check_length(self, num_chars: int, param: str) -> None:
        if num_chars > self.max_model_len * self.max_token_chars:
            raise APIError(400, f"{param} is {num_chars} characters, at least "
                                f"{-(-num_chars // self.max_token_chars)} tokens: longer than the model's context "
                                f"(max_model_len is {self.max_model_len})", param=param)

    def _validate_ids(self, ids: list[int], param: str) -> None:
        try:
            self.validate_prompt(ids)
        except ValueError as e:
            raise APIError(400, str(e), param=param) from None

    def completion(self, tokenizer, body: bytes) -> Prepared:
        req = parse_request(self.models.completion, body)
        prompts = req.prompts()
        model, params, field, _ = self._common(req, len(prompts))
        texts, ids = [], []
        for p in prompts:
            if isinstance(p, str):
                self._check_length(len(p), "prompt")
                texts.append(p)
                ids.append(_encode(tokenizer, p))
            else:
                texts.append(None)
                ids.append(list(p))
            self._validate_ids(ids[-1], "prompt")
        return Prepared(req, model, params, ids, texts, field, lora_request=self._lora(model))

    def chat(self, tokenizer, body: bytes) -> Prepared:
        req = parse_request(self.models.chat, body)
        model, params, field, tools = self._common(req, 1)
        messages = req.template_messages()
        num_chars = sum(len(m.get("content") or "") for m in messages)
        num_chars += sum(len(c.function.arguments) for m in req.messages for c in m.tool_calls or [])
        self._check_length(num_chars, "messages")
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions", param="messages")
        try:
            ids = tokenizer.apply_chat_template(messages, tools=tools.template_tools, tokenize=True,
                                                add_generation_prompt=req.add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - template errors (e.g. role order) are the client's
            raise APIError(400, f"the chat template rejected the messages: {str(e)[:300]}", param="messages") from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        ids = list(ids)
        self._validate_ids(ids, "messages")
        return Prepared(req, model, params, [ids], [None], field, tools.parser, self._lora(model))


def _describe(tool_choice) -> str:
    return repr(tool_choice) if isinstance(tool_choice, str) else f"function {tool_choice.function.name!r}"


def _encode(tokenizer, text: str) -> list[int]:
    try:
        return tokenizer.encode(text)
    except Exception as e:  # noqa: BLE001 - what the tokenizer refuses is the client's input
        raise APIError(400, f"the tokenizer rejected the prompt: {str(e)[:300]}", param="prompt") from None
