"""Bounds uvicorn leaves open: time to send a request's headers, and open connections.

uvicorn arms its keep-alive timer only after a response, and every byte received cancels it,
so a connection that never sends a request, or sends a header line every few seconds, is
held indefinitely; and nothing but the open-files limit bounds the connections. This h11
protocol adds two rules:

- ``header_timeout``: a connection must complete a request's headers within this many
  seconds of opening or of its previous response, however it dribbles them; otherwise it is
  closed (what arrived is a partial request: nothing valid can be answered).
- ``max_connections``: a connection opened while that many are open is answered at once
  with a 503 in OpenAI's error shape and ``Connection: close``, then closed; the ones already
  open (a keep-alive client, a health probe's) are served as usual.

Header bytes are bounded by h11's ``max_incomplete_event_size`` (uvicorn's
``h11_max_incomplete_event_size``): more is a 400.
"""
from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

from specdec.server.json_response import dumps_strict
from specdec.server.protocol import APIError

REFUSED_LINGER = 1.0  # seconds a refused connection may still send (discarded) before it is closed


def guarded_protocol(header_timeout: float, max_connections: int, on_refused=None) -> type[H11Protocol]:
    """An ``H11Protocol`` class for ``uvicorn.Config(http=...)`` with these bounds;
    ``on_refused()`` is called for each connection turned away (metrics)."""
    if header_timeout <= 0 or max_connections < 1:
        raise ValueError(f"--header-timeout must be > 0 and --max-connections >= 1, got {header_timeout} "
                         f"and {max_connections}")
    error = APIError(503, f"the server has {max_connections} open connections (--max-connections); retry later",
                     code="too_many_connections")
    body = dumps_strict(error.body()).encode()
    refusal = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
               b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _refused = False

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self._refuse()
                return
            self._arm_header_timer()

        def _refuse(self) -> None:
            self._refused = True
            self.connections.discard(self)  # a refused connection does not hold a place
            if on_refused is not None:
                on_refused()
            self.transport.write(refusal)
            if self.transport.can_write_eof():
                self.transport.write_eof()  # FIN after the 503; a close with unread input would be an RST
            self.loop.call_later(REFUSED_LINGER, self.transport.close)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return  # its request is answered already
            super().data_received(data)

        def on_response_complete(self) -> None:
            self._arm_header_timer()  # before super(): a pipelined request it starts disarms it
            super().on_response_complete()

        def _arm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(header_timeout, self._header_deadline, self.cycle)

        def _header_deadline(self, cycle) -> None:
            self._header_timer = None
            waiting = self.cycle is cycle and (cycle is None or cycle.response_complete)
            if waiting and not self.transport.is_closing():
                self.transport.close()

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().connection_lost(exc)

    return GuardedH11Protocol
