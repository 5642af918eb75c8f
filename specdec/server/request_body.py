"""A POST body: read within a byte limit and a time limit, parsed as strict JSON.

Strict means: only ``application/json`` (a cross-origin page can send ``text/plain`` without
a CORS preflight, so accepting it would let any web page drive a key-less local server);
no ``NaN`` / ``Infinity`` literals and no float that overflows to infinity; nesting at most
``MAX_JSON_DEPTH`` deep; integers within Python's digit limit; no string holding a lone
surrogate (no tokenizer or UTF-8 encoder accepts one). Each is a 4xx naming the problem.
"""
from __future__ import annotations

import asyncio
import json
import math

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from specdec.server.protocol import APIError, validation_error

MAX_JSON_DEPTH = 32  # OpenAI bodies nest 5 deep (messages.0.content.0.text); tool schemas a little more


CLIENT_CLOSED = 499  # nginx's "client closed request": counted, never sent (nobody is there to read it)


async def read_body(request: Request, max_bytes: int, timeout: float) -> bytes:
    """The body, or a 415 (not JSON), 413 (over ``max_bytes``) or 408 (not complete within ``timeout`` s);
    a client that closes its connection before the body is complete is a quiet ``CLIENT_CLOSED``."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/json":
        raise APIError(415, f"Content-Type must be application/json, got {content_type or 'none'!r}",
                       code="unsupported_media_type")
    announced = request.headers.get("content-length")
    if announced is not None and announced.isdigit() and int(announced) > max_bytes:
        raise _too_large(int(announced), max_bytes)
    chunks: list[bytes] = []
    size = 0

    async def read() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(size, max_bytes)
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), timeout)
    except ClientDisconnect:
        raise APIError(CLIENT_CLOSED, f"the client closed the connection after {size} bytes of its body",
                       code="client_closed") from None
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s (--body-timeout)",
                       code="body_timeout") from None
    return b"".join(chunks)


def _too_large(size: int, max_bytes: int) -> APIError:
    return APIError(413, f"the request body is {size} bytes or more, over this server's limit of {max_bytes} "
                         "(--max-body-bytes)", code="body_too_large")


def _invalid(message: str) -> APIError:
    return APIError(400, f"malformed JSON body: {message}", code="invalid_json")


def _reject_constant(name: str):
    raise _invalid(f"{name} is not JSON (only finite numbers are)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _invalid(f"the number {text[:40]} is out of range")
    return value


def loads_strict(body: bytes):
    try:
        data = json.loads(body, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise _invalid(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _invalid(str(e)) from None
    except ValueError as e:  # an integer past sys.get_int_max_str_digits()
        raise _invalid(str(e)) from None
    check_values(data)
    return data


def check_values(data) -> None:
    """Depth and string checks, iteratively (a recursive walk would fail where json.loads did not)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            _check_string(value)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise _invalid(f"nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(value, dict):
            for key, item in value.items():
                _check_string(key)
                if isinstance(item, (str, dict, list)):
                    stack.append((item, depth + 1))
        else:
            stack.extend((item, depth + 1) for item in value if isinstance(item, (str, dict, list)))


def _check_string(s: str) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _invalid(f"a string holds a lone surrogate ({s[e.start]!r} at character {e.start}); "
                       "send UTF-8 text or escaped surrogate pairs") from None


def parse_request(model: type[BaseModel], body: bytes):
    """Raw body -> request model; malformed JSON and wrong types are 400s naming the problem."""
    data = loads_strict(body)
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e, getattr(model, "limit_flags", None)) from None
