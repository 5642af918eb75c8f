"""The FastAPI app: routes, API-key check, OpenAI-shaped errors, engine thread lifecycle.

``build_app(engine, settings)`` wires an LLMEngine into an app; the engine thread starts
with the app's lifespan and is stopped (in-flight requests aborted, thread joined) when
uvicorn shuts down, which it does on SIGTERM after draining open requests.
"""
from __future__ import annotations

import hmac
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

import specdec
from specdec.engine.engine_core import LLMEngine
from specdec.server.admission import Admission
from specdec.server.async_engine import AsyncEngine
from specdec.server.metrics import ServerMetrics
from specdec.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_request
from specdec.server.serving import OpenAIServing

logger = logging.getLogger("specdec.server")


@dataclass
class ServerSettings:
    model_name: str
    api_key: str | None = None
    max_queue: int = 256  # sequences that may wait for a batch slot, beyond max_num_seqs running
    queue_full_policy: str = "reject"  # "reject" -> 503, "wait" -> queue in arrival order
    engine_stop_timeout: float = 30.0


def build_app(engine: LLMEngine, settings: ServerSettings) -> FastAPI:
    async_engine = AsyncEngine(engine)
    metrics = ServerMetrics(settings.model_name, lambda: async_engine.snapshot)
    async_engine.metrics = metrics
    admission = Admission(engine.config.max_num_seqs + settings.max_queue, settings.queue_full_policy)
    serving = OpenAIServing(async_engine, admission, [settings.model_name])
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        logger.info("engine thread started; serving %r", settings.model_name)
        try:
            yield
        finally:
            async_engine.stop(settings.engine_stop_timeout)
            logger.info("engine thread stopped")

    app = FastAPI(title="specdec", version=specdec.__version__, lifespan=lifespan)
    app.state.async_engine, app.state.serving, app.state.metrics = async_engine, serving, metrics

    def error_response(e: APIError) -> JSONResponse:
        metrics.request_rejected(e.status)
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return error_response(APIError(400, f"invalid request: {e.errors()[0].get('msg')}"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return error_response(APIError(e.status_code, str(e.detail)))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        logger.exception("unhandled error in %s", request.url.path)
        return error_response(APIError(500, f"internal server error: {type(e).__name__}"))

    def check_api_key(request: Request) -> None:
        """A dependency of every /v1 route (not middleware: BaseHTTPMiddleware would sit
        between streaming responses and the client's disconnect)."""
        if not settings.api_key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), settings.api_key.encode()):
            raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer KEY')", code="invalid_api_key")

    v1 = [Depends(check_api_key)]

    @app.post("/v1/completions", dependencies=v1)
    async def completions(request: Request):
        req = parse_request(CompletionRequest, await request.body())
        return await serving.completions(req, request)

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat_completions(request: Request):
        req = parse_request(ChatCompletionRequest, await request.body())
        return await serving.chat(req, request)

    @app.get("/v1/models", dependencies=v1)
    async def models():
        data = [{"id": name, "object": "model", "created": started, "owned_by": "specdec",
                 "root": engine.config.model, "max_model_len": engine.max_model_len} for name in serving.model_names]
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health():
        s = async_engine.snapshot
        body = {"status": "ok" if async_engine.is_alive else "engine_dead",
                "num_running": s.get("num_running"), "num_waiting": s.get("num_waiting"),
                "num_in_flight": s.get("num_in_flight"), "num_free_kv_blocks": s.get("num_free_kv_blocks"),
                "num_kv_blocks": s.get("num_kv_blocks"), "admission_in_use": admission.num_in_use,
                "admission_waiting": admission.num_waiting,
                "admission_capacity": admission.capacity}
        return JSONResponse(body, status_code=200 if async_engine.is_alive else 503)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return {"version": specdec.__version__}

    return app
