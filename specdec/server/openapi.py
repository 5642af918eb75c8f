"""/openapi.json as the contract: every route's request and response models, with their status codes.

The routes read their bodies themselves (request_body.py: byte and time limits, strict JSON,
parsed on a worker thread), so FastAPI does not see the request models; ``install_openapi``
publishes the very classes the Preparer validates with (``Preparer.models``, this server's
limits as constraints), and the stream chunk models under each generation route's
``text/event-stream`` answer: each event's ``data`` is a chunk or an in-band error as JSON
(``contentSchema``), and the last is ``[DONE]``.
"""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from specdec.server.request_models import RequestModels
from specdec.server.response_models import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
    ErrorResponse,
)

_ERRORS = {
    400: "invalid JSON, a wrong type, a value out of range or over a limit (the message names the field)",
    401: "missing or wrong API key (--api-key)",
    404: "the model is not the one served",
    408: "the body did not arrive within --body-timeout",
    413: "the body is over --max-body-bytes",
    415: "the Content-Type is not application/json",
    500: "a request that made an engine step fail (it fails alone)",
    503: "the queue is full, the server is shutting down or the engine is not running",
}
REF = "#/components/schemas/{model}"


def error_responses(*statuses: int) -> dict:
    return {s: {"model": ErrorResponse, "description": _ERRORS[s]} for s in statuses}


def generation_responses(body: type[BaseModel], chunk: type[BaseModel]) -> dict:
    data = {"anyOf": [
        {"type": "string", "contentMediaType": "application/json",
         "contentSchema": {"anyOf": [{"$ref": REF.format(model=chunk.__name__)},
                                     {"$ref": REF.format(model=ErrorResponse.__name__)}]}},
        {"const": "[DONE]"}],
        "description": f"a {chunk.__name__} or an in-band ErrorResponse as JSON; the last event's data is [DONE]"}
    sse = {"schema": {"type": "object", "properties": {"data": data, "event": {"type": "string"}},
                      "required": ["data"], "description": "one server-sent event (text/event-stream, OpenAPI "
                                                           "3.1: the schema describes each event)"}}
    return {200: {"model": body, "description": "the completion (JSON), or with stream: true server-sent "
                                                 "events, each a chunk, then data: [DONE]",
                  "content": {"text/event-stream": sse}},
            **error_responses(400, 401, 404, 408, 413, 415, 500, 503)}


def tokenize_responses(body: type[BaseModel]) -> dict:
    return {200: {"model": body}, **error_responses(400, 401, 404, 408, 413, 415, 503)}


GENERATION_ROUTES = {"/v1/completions": (CompletionResponse, CompletionChunk),
                     "/v1/chat/completions": (ChatCompletionResponse, ChatCompletionChunk)}


def request_bodies(models: RequestModels) -> dict[str, tuple[type[BaseModel], ...]]:
    """Each POST route's request models (more than one: the body is any of them)."""
    from specdec.server.tokenize import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest

    return {"/v1/completions": (models.completion,), "/v1/chat/completions": (models.chat,),
            "/tokenize": (TokenizeCompletionRequest, TokenizeChatRequest), "/detokenize": (DetokenizeRequest,)}


def model_schemas(model: type[BaseModel]) -> tuple[dict, dict]:
    """``model``'s JSON schema (validation mode) with ``$ref``s into components, and its definitions."""
    schema = model.model_json_schema(ref_template=REF, mode="validation")
    return schema, schema.pop("$defs", {})


def install_openapi(app: FastAPI, models: RequestModels, max_body_bytes: int, max_schema_chars: int) -> None:
    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                          description="specdec's OpenAI-compatible API; the request schemas carry this "
                                      "server's limits.")
        components = doc.setdefault("components", {}).setdefault("schemas", {})
        extra = [chunk for _, chunk in GENERATION_ROUTES.values()]
        for path, bodies in request_bodies(models).items():
            for model in bodies:
                schema, defs = model_schemas(model)
                for name, d in {**defs, model.__name__: schema}.items():
                    if components.get(name, d) != d:
                        raise RuntimeError(f"two different schemas are named {name!r} in /openapi.json")
                    components[name] = d
            refs = [{"$ref": REF.format(model=model.__name__)} for model in bodies]
            doc["paths"][path]["post"]["requestBody"] = {
                "required": True, "content": {"application/json": {"schema": refs[0] if len(refs) == 1
                                                                   else {"anyOf": refs}}},
                "description": f"strict JSON (no NaN / Infinity, nesting at most 32 deep), at most {max_body_bytes} "
                               f"bytes (--max-body-bytes, else 413); each JSON schema, regex, grammar or choice list, "
                               f"and all tools together, at most {max_schema_chars} characters as JSON "
                               "(--max-schema-chars, else 400)"}
        for model in extra:
            schema, defs = model_schemas(model)
            components.update(defs)
            components[model.__name__] = schema
        app.openapi_schema = doc
        return doc

    app.openapi = openapi
