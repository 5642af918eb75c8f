"""The published schema is the contract: /openapi.json holds, for every route, the request
model the server validates bodies with (this server's limits as constraints) and the models
of every answer, errors included; real answers (bodies and each stream chunk) validate
against them and are strict JSON. In process (ASGI), on the tiny model."""
from __future__ import annotations

import json

import pytest
from conftest import INPROC_LIMITS

from specdec.server.fuzz import check_answer, loads_strict
from specdec.server.openapi import REF, model_schemas, request_bodies
from specdec.server.response_models import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
    ErrorResponse,
    Health,
    ModelList,
    Version,
)

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def answer(path: str, r) -> list[dict]:
    """The body or the stream's chunks, each checked: strict JSON, then its response model."""
    return check_answer(path, r.status_code, r.headers.get("content-type", ""), r.content)


def _resolve(doc: dict, schema: dict) -> dict:
    return doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]


def test_request_bodies_are_the_models_the_server_validates_with(asgi_app, asgi_client):
    doc = asgi_client.get("/openapi.json").json()
    models = asgi_app.state.serving.preparer.models
    for path, bodies in request_bodies(models).items():
        body = doc["paths"][path]["post"]["requestBody"]
        assert body["required"] is True
        published = body["content"]["application/json"]["schema"]
        refs = published.get("anyOf", [published])
        assert len(refs) == len(bodies), path
        for ref, model in zip(refs, bodies):
            schema, defs = model_schemas(model)
            assert _resolve(doc, ref) == schema, path  # drift: the server validates with something else
            for name, d in defs.items():
                assert doc["components"]["schemas"][name] == d, name
    # the limits are schema constraints
    completion = _resolve(doc, doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"])
    props = completion["properties"]
    assert props["n"]["maximum"] == INPROC_LIMITS["max_n"]
    assert {"type": "integer", "minimum": 1, "maximum": INPROC_LIMITS["max_tokens"]} in props["max_tokens"]["anyOf"]
    assert {"type": "integer", "minimum": 0, "maximum": INPROC_LIMITS["max_logprobs"]} in props["logprobs"]["anyOf"]
    assert any(s.get("maxItems") == INPROC_LIMITS["max_stop"] for s in props["stop"]["anyOf"])
    assert props["temperature"]["anyOf"][0]["maximum"] == 2
    chat = _resolve(doc, doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"])
    assert chat["properties"]["messages"]["maxItems"] == INPROC_LIMITS["max_messages"]


def test_every_answer_is_declared_with_its_model_and_status(asgi_client):
    doc = asgi_client.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for path, (body, chunk) in {"/v1/completions": (CompletionResponse, CompletionChunk),
                                "/v1/chat/completions": (ChatCompletionResponse, ChatCompletionChunk)}.items():
        responses = doc["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "404", "408", "413", "415", "500", "503"} <= set(responses), path
        ok = responses["200"]["content"]
        assert ok["application/json"]["schema"] == {"$ref": REF.format(model=body.__name__)}
        data = ok["text/event-stream"]["schema"]["properties"]["data"]
        assert {"$ref": REF.format(model=chunk.__name__)} in data["anyOf"][0]["contentSchema"]["anyOf"]
        assert chunk.__name__ in schemas
        for status in ("400", "503"):
            assert responses[status]["content"]["application/json"]["schema"] == {"$ref": REF.format(model="ErrorResponse")}
    assert schemas["ErrorBody"]["required"] == ["message", "type", "param", "code"]
    metrics = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    for path, model in {"/v1/models": ModelList, "/health": Health, "/version": Version}.items():
        schema = doc["paths"][path]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
        assert schema == {"$ref": REF.format(model=model.__name__)}
    assert "503" in doc["paths"]["/health"]["get"]["responses"]


def test_get_routes_answer_their_models(asgi_client):
    ModelList.model_validate(loads_strict(asgi_client.get("/v1/models").content))
    assert Health.model_validate(loads_strict(asgi_client.get("/health").content)).status == "ok"
    Version.model_validate(loads_strict(asgi_client.get("/version").content))
    r = asgi_client.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain") and "specdec:" in r.text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path, body", [
    # more top logprobs than the constraint leaves tokens: the rest have probability zero
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "logprobs": 2, "guided_choice": ["a"]}),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 4, "response_format": {"type": "json_object"}}),
])
def test_masked_tokens_have_the_floor_logprob_and_answers_are_strict_json(asgi_client, path, body, stream):
    r = asgi_client.post(path, json={**body, "stream": stream})
    assert r.status_code == 200, r.text
    parsed = answer(path, r)
    values = []
    for item in parsed:
        for choice in item["choices"]:
            lp = choice["logprobs"]
            if lp is None:
                continue
            if "tokens" in lp:
                values += [v for top in lp["top_logprobs"] for v in top.values()]
            else:
                values += [t["logprob"] for entry in lp["content"] for t in entry["top_logprobs"]]
    assert -9999.0 in values, values  # the masked tokens are there, at the floor
    assert all(-9999.0 <= v <= 0 for v in values)


def test_every_error_is_openai_shaped_strict_json(asgi_client):
    cases = [("/v1/completions", {"prompt": "x", "n": 3}, 400, "--max-n"),
             ("/v1/completions", {"prompt": "x", "stop": ["s"] * 5}, 400, "--max-stop"),
             ("/v1/completions", {"prompt": "x", "stop": "s" * 257}, 400, "--max-stop-length"),
             ("/v1/completions", {"prompt": [10**6]}, 400, "vocabulary"),
             ("/v1/completions", {"prompt": "x", "max_tokens": 5}, 400, "--max-tokens-limit"),
             ("/v1/chat/completions", {**CHAT, "top_logprobs": 6, "logprobs": True}, 400, "--max-logprobs"),
             ("/v1/completions", {"prompt": "x", "model": "other"}, 404, "does not exist")]
    for path, body, status, fragment in cases:
        r = asgi_client.post(path, json=body)
        assert r.status_code == status, (body, r.text)
        err = answer(path, r)[0]["error"]
        assert fragment in err["message"], (body, err)
    r = asgi_client.post("/v1/completions", data=b"x" * (INPROC_LIMITS["max_body_bytes"] + 1),
                         headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    answer("/v1/completions", r)
    assert asgi_client.post("/v1/completions", data=b"{}", headers={"Content-Type": "text/plain"}).status_code == 415
