"""The FastAPI app: routes, keys, OpenAI-shaped errors, the engine thread and the drain.

``build_app(engine, settings)`` wires an EngineCore into an app; the engine thread starts
with the app's lifespan. ``app.state.begin_drain()`` (cli.py calls it on SIGTERM / SIGINT)
turns new requests away with 503 and, ``shutdown_timeout`` seconds later, ends whatever
still runs with an in-band error (streams) or a 503 (the rest), so uvicorn's own drain,
which would cut them, finds nothing left; then the engine thread is stopped and joined.
"""
from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import PlainTextResponse, Response

import specdec
from specdec.engine.engine_core import EngineCore
from specdec.server.admission import Admission
from specdec.server.allowed_hosts import AllowedHosts
from specdec.server.async_engine import AsyncEngine, EngineDead
from specdec.server.error_middleware import InternalErrors
from specdec.server.json_response import StrictJSONResponse
from specdec.server.limits import RequestLimits
from specdec.server.lora_models import LoRAModels
from specdec.server.metrics import ServerMetrics
from specdec.server.openapi import (GENERATION_ROUTES, error_responses, generation_responses, install_openapi,
                                    tokenize_responses)
from specdec.server.prepare import Preparer, max_token_chars
from specdec.server.protocol import APIError
from specdec.server.reasoning import get_reasoning_parser
from specdec.server.request_body import read_body
from specdec.server.response_models import DetokenizeResponse, Health, ModelList, TokenizeResponse, Version
from specdec.server.serving import OpenAIServing
from specdec.server.tokenize import Tokenization
from specdec.server.tokenizer_pool import TokenizerPool
from specdec.tool_parsers import get_tool_parser, parser_for_template

logger = logging.getLogger("specdec.server")


@dataclass
class ServerSettings:
    model_name: str
    api_key: str | None = None
    metrics_api_key: str | None = None  # required on /metrics when set
    max_queue: int = 256  # sequences that may wait for a batch slot, beyond max_num_seqs running
    queue_full_policy: str = "reject"  # "reject" -> 503, "wait" -> queue in arrival order
    max_waiting: int = 256  # requests that may wait for admission (policy "wait")
    limits: RequestLimits = field(default_factory=RequestLimits)
    write_timeout: float = 30.0  # a stream whose client takes no write for this long is aborted
    tokenizer_workers: int = 2
    max_pending_prepares: int = 64
    shutdown_timeout: float = 30.0
    engine_stop_timeout: float = 30.0
    enable_docs: bool = False  # /docs, /redoc, /openapi.json
    allowed_hosts: list[str] = field(default_factory=list)  # empty: any Host header
    tool_call_parser: str | None = None  # None: the one the chat template's format implies, if any
    reasoning_parser: str | None = None  # reasoning.py: thinking -> reasoning_content; None: all is content
    on_engine_death: Callable[[], None] | None = None  # event-loop thread; cli.py exits non-zero
    # LoRA (an engine with enable_lora): adapters served as models, [(name, PEFT folder)]; runtime
    # loading (/v1/load_lora_adapter, /v1/unload_lora_adapter) only from inside lora_allowed_dirs
    lora_modules: list[tuple[str, str]] = field(default_factory=list)
    enable_lora_runtime_updates: bool = False
    lora_allowed_dirs: list[str] = field(default_factory=list)


def _bearer_ok(request: Request, key: str) -> bool:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def build_app(engine: EngineCore, settings: ServerSettings) -> FastAPI:
    async_engine = AsyncEngine(engine)
    admission = Admission(engine.config.max_num_seqs + settings.max_queue, settings.queue_full_policy,
                          settings.max_waiting)
    metrics = ServerMetrics(settings.model_name, lambda: {**async_engine.snapshot,
                                                          "admission_in_use": admission.num_in_use,
                                                          "admission_waiting": admission.num_waiting})
    async_engine.metrics = metrics
    pool = TokenizerPool(engine.tokenizer, settings.tokenizer_workers, settings.max_pending_prepares)
    tool_parser = (get_tool_parser(settings.tool_call_parser) if settings.tool_call_parser
                   else parser_for_template(getattr(engine.tokenizer, "chat_template", None)))
    reasoning_parser = (get_reasoning_parser(settings.reasoning_parser, engine.tokenizer)
                        if settings.reasoning_parser else None)
    lora_models = _lora_models(engine, settings)
    preparer = Preparer(settings.limits, [settings.model_name], engine.max_model_len, engine.vocab_size,
                        admission.capacity, max_token_chars(engine.tokenizer), engine.validate_prompt,
                        engine.compile_grammar, tool_parser, lora_models=lora_models,
                        reasoning_parser=reasoning_parser)
    serving = OpenAIServing(async_engine, admission, preparer, pool, settings.write_timeout)
    started = int(time.time())
    limits = settings.limits

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        import asyncio

        loop = asyncio.get_running_loop()
        if settings.on_engine_death is not None:
            async_engine.on_death = lambda: loop.call_soon_threadsafe(settings.on_engine_death)
        app.state.loop = loop
        async_engine.start()
        logger.info("engine thread started; serving %r; tool-call parser: %s; reasoning parser: %s",
                    settings.model_name, tool_parser.name if tool_parser else "none",
                    reasoning_parser.name if reasoning_parser else "none")
        try:
            yield
        finally:
            pool.shutdown()
            async_engine.stop(settings.engine_stop_timeout)
            logger.info("engine thread stopped")

    docs = {} if settings.enable_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="specdec", version=specdec.__version__, lifespan=lifespan,
                  default_response_class=StrictJSONResponse, **docs)
    install_openapi(app, preparer.models, settings.limits.max_body_bytes, settings.limits.max_schema_chars)
    app.state.async_engine, app.state.serving, app.state.metrics = async_engine, serving, metrics
    app.add_middleware(InternalErrors, on_error=metrics.request_rejected)
    if settings.allowed_hosts:
        app.add_middleware(AllowedHosts, hosts=settings.allowed_hosts)

    def begin_drain() -> None:
        """Stop admitting; end what still runs ``shutdown_timeout`` s later (event-loop thread)."""
        if serving.draining:
            return
        serving.draining = True
        admission.close("the server is shutting down")
        logger.info("draining: %d sequences in flight, %.0f s to finish", admission.num_in_use,
                    settings.shutdown_timeout)
        error = EngineDead(f"the server is shutting down: the request ran past --shutdown-timeout "
                           f"({settings.shutdown_timeout:g} s)")
        app.state.loop.call_later(settings.shutdown_timeout, async_engine.fail_all, error)

    app.state.begin_drain = begin_drain

    def error_response(e: APIError, headers: dict | None = None) -> Response:
        metrics.request_rejected(e.status)
        headers = {**(headers or {}), **({"WWW-Authenticate": "Bearer"} if e.status == 401 else {})}
        return StrictJSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return error_response(APIError(400, f"invalid request: {e.errors()[0].get('msg')}"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return error_response(APIError(e.status_code, str(e.detail)), e.headers)  # 405 keeps its Allow

    async def check_api_key(request: Request) -> None:
        """A dependency of every /v1 route (not middleware: BaseHTTPMiddleware would sit
        between streaming responses and the client's disconnect); async, because FastAPI runs
        a sync dependency on its thread pool, one more thread (and malloc arena) per request."""
        if settings.api_key and not _bearer_ok(request, settings.api_key):
            raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer KEY')", code="invalid_api_key")

    v1 = [Depends(check_api_key)]

    @app.post("/v1/completions", dependencies=v1, responses=generation_responses(*GENERATION_ROUTES["/v1/completions"]))
    async def completions(request: Request):
        body = await read_body(request, limits.max_body_bytes, limits.body_timeout)
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions", dependencies=v1,
              responses=generation_responses(*GENERATION_ROUTES["/v1/chat/completions"]))
    async def chat_completions(request: Request):
        body = await read_body(request, limits.max_body_bytes, limits.body_timeout)
        return await serving.chat(body, request)

    tokenization = Tokenization(preparer.check_model, limits, engine.max_model_len, engine.vocab_size)

    @app.post("/tokenize", dependencies=v1, responses=tokenize_responses(TokenizeResponse))
    async def tokenize(request: Request):
        body = await read_body(request, limits.max_body_bytes, limits.body_timeout)
        return await pool.run(tokenization.tokenize, body)

    @app.post("/detokenize", dependencies=v1, responses=tokenize_responses(DetokenizeResponse))
    async def detokenize(request: Request):
        body = await read_body(request, limits.max_body_bytes, limits.body_timeout)
        return await pool.run(tokenization.detokenize, body)

    @app.get("/v1/models", dependencies=v1, responses={200: {"model": ModelList}, **error_responses(401)})
    async def models():
        data = [{"id": name, "object": "model", "created": started, "owned_by": "specdec",
                 "root": engine.config.model, "parent": None, "max_model_len": engine.max_model_len}
                for name in serving.model_names]
        for name in lora_models.names() if lora_models is not None else []:
            lora = lora_models.lookup(name)
            if lora is not None:
                data.append({"id": name, "object": "model", "created": started, "owned_by": "specdec",
                             "root": lora.lora_path, "parent": settings.model_name,
                             "max_model_len": engine.max_model_len})
        return {"object": "list", "data": data}

    if lora_models is not None and settings.enable_lora_runtime_updates:
        import asyncio

        async def lora_body(request: Request) -> dict:
            import json

            raw = await read_body(request, limits.max_body_bytes, limits.body_timeout)
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise APIError(400, "the body must be a JSON object") from None
            if not isinstance(body, dict):
                raise APIError(400, "the body must be a JSON object")
            return body

        @app.post("/v1/load_lora_adapter", dependencies=v1)
        async def load_lora_adapter(request: Request):
            body = await lora_body(request)
            lora = await asyncio.to_thread(lora_models.load, body.get("lora_name"), body.get("lora_path"))
            return Response(f"Success: LoRA adapter '{lora.lora_name}' added successfully.", media_type="text/plain")

        @app.post("/v1/unload_lora_adapter", dependencies=v1)
        async def unload_lora_adapter(request: Request):
            body = await lora_body(request)
            lora_models.unload(body.get("lora_name"))
            return Response(f"Success: LoRA adapter '{body['lora_name']}' removed successfully.",
                            media_type="text/plain")

    @app.get("/health", responses={200: {"model": Health}, 503: {"model": Health, "description": "engine dead or "
                                                                                              "shutting down"}})
    async def health():
        """Liveness for probes, without internals (those are in /metrics)."""
        if not async_engine.is_alive:
            return StrictJSONResponse({"status": "engine_dead"}, status_code=503)
        if serving.draining:
            return StrictJSONResponse({"status": "shutting_down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse, responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus text format"},
        **error_responses(401)})
    async def prometheus_metrics(request: Request):
        if settings.metrics_api_key and not _bearer_ok(request, settings.metrics_api_key):
            raise APIError(401, "missing or invalid metrics key (send 'Authorization: Bearer KEY')",
                           code="invalid_api_key")
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version", responses={200: {"model": Version}})
    async def version():
        return {"version": specdec.__version__}

    return app


def _lora_models(engine: EngineCore, settings: ServerSettings) -> LoRAModels | None:
    """The adapters served by name (``--lora-modules``), each validated now: a bad one stops the start."""
    if not engine.config.enable_lora:
        if settings.lora_modules or settings.enable_lora_runtime_updates:
            raise ValueError("--lora-modules / --enable-lora-runtime-updates need --enable-lora")
        return None
    if settings.enable_lora_runtime_updates and not settings.lora_allowed_dirs:
        raise ValueError("--enable-lora-runtime-updates needs at least one --lora-allowed-dir to load adapters from")
    models = LoRAModels(settings.model_name, engine.validate_lora, engine.remove_lora, engine.lora_registry.new_id,
                        settings.lora_allowed_dirs)
    for name, path in settings.lora_modules:
        models.add(name, path)
    return models
