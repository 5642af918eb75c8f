"""InternalErrors: an unexpected exception becomes one logged 500 in OpenAI's error shape,
and the connection stays usable.

Starlette's own last-resort handler (``ServerErrorMiddleware``) re-raises after answering,
so uvicorn logs the traceback a second time and drops the connection without
``Connection: close``: a keep-alive client's next request on it meets a reset. This
middleware sits inside it, answers and returns normally, so the connection is kept. If the
response had already started (a stream), nothing valid can be sent: it re-raises and the
server closes the connection, which is the only honest end of a half-sent body.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from specdec.server.json_response import StrictJSONResponse
from specdec.server.protocol import APIError

logger = logging.getLogger("specdec.server")


class InternalErrors:
    def __init__(self, app, on_error: Callable[[int], None] | None = None):
        self.app = app
        self.on_error = on_error  # called with the status (metrics)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception as e:  # noqa: BLE001 - the last resort: anything a route did not turn into a 4xx
            logger.exception("unhandled error in %s", scope.get("path"))
            if started:
                raise
            if self.on_error is not None:
                self.on_error(500)
            error = APIError(500, f"internal server error: {type(e).__name__}")
            await StrictJSONResponse(error.body(), status_code=500)(scope, receive, send)
