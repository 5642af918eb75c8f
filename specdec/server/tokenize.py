"""``/tokenize`` and ``/detokenize`` as vLLM serves them.

``POST /tokenize`` takes a ``prompt`` (with ``add_special_tokens``, default true) or chat
``messages`` (rendered by the chat template, with ``add_generation_prompt`` (true),
``continue_final_message``, ``add_special_tokens`` (false), ``tools``,
``chat_template_kwargs`` / ``enable_thinking``) and answers ``{"count", "max_model_len",
"tokens", "token_strs"}`` (the token strings when ``return_token_strs``). ``POST /detokenize``
takes ``tokens`` and answers ``{"prompt"}``. Both run on a TokenizerPool thread; every
problem is a 4xx naming the field (a token id outside the vocabulary: ``tokens.3``).
"""
from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field

from specdec.server.limits import RequestLimits
from specdec.server.protocol import APIError, ChatCompletionRequest, ChatMessage, Tool, _Strict
from specdec.server.reasoning import template_kwargs
from specdec.server.request_body import loads_strict, parse_request


class TokenizeCompletionRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Strict):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict | None = None
    enable_thinking: bool | None = None
    return_token_strs: bool = False

    template_messages = ChatCompletionRequest.template_messages  # reads self.messages only


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


@dataclass
class Tokenization:
    check_model: object  # Preparer.check_model: a 404 for a model this server does not serve
    limits: RequestLimits
    max_model_len: int
    vocab_size: int

    def tokenize(self, tokenizer, body: bytes) -> dict:
        data = loads_strict(body)
        chat = isinstance(data, dict) and "messages" in data
        req = parse_request(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)
        self.check_model(req.model)
        if chat:
            ids = self._chat_ids(tokenizer, req)
        else:
            try:
                ids = list(tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
            except Exception as e:  # noqa: BLE001 - what the tokenizer refuses is the client's input
                raise APIError(400, f"the tokenizer rejected the prompt: {str(e)[:300]}", param="prompt") from None
        strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    def _chat_ids(self, tokenizer, req: TokenizeChatRequest) -> list[int]:
        if len(req.messages) > self.limits.max_messages:
            raise APIError(400, f"messages holds {len(req.messages)} messages, more than this server's limit of "
                                f"{self.limits.max_messages} (--max-messages)", param="messages", code="limit_exceeded")
        if req.continue_final_message and req.add_generation_prompt:
            raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true",
                           param="continue_final_message")
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "this model's tokenizer has no chat template; send a prompt", param="messages")
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        try:
            text = tokenizer.apply_chat_template(
                req.template_messages(), tools=tools, tokenize=False, add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message, **template_kwargs(req))
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - template errors (e.g. role order) are the client's
            raise APIError(400, f"the chat template rejected the messages: {str(e)[:300]}", param="messages") from None
        return list(tokenizer.encode(text, add_special_tokens=req.add_special_tokens))

    def detokenize(self, tokenizer, body: bytes) -> dict:
        req = parse_request(DetokenizeRequest, body)
        self.check_model(req.model)
        for i, t in enumerate(req.tokens):
            if not 0 <= t < self.vocab_size:
                raise APIError(400, f"tokens.{i} is {t}, not a token id of this model (0 to {self.vocab_size - 1})",
                               param=f"tokens.{i}")
        return {"prompt": tokenizer.decode(req.tokens)}
