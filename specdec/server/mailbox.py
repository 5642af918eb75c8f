"""Mailbox: where the engine thread's outputs for one HTTP request wait for it to read them.

Outputs are cumulative (the full text and token ids so far), so a newer one for a prompt
replaces an unread older one: a mailbox holds at most one output per prompt and one error,
however slowly its client reads, never a backlog of copies. Event-loop thread only.
"""
from __future__ import annotations

import asyncio

from specdec.outputs import RequestOutput


class Mailbox:
    def __init__(self) -> None:
        self._latest: dict[str, RequestOutput] = {}
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            if self._error is None:  # the first error is the cause; later ones follow from it
                self._error = item
        else:
            self._latest[item.request_id] = item
        self._ready.set()

    @property
    def num_held(self) -> int:
        return len(self._latest) + (self._error is not None)

    async def take(self) -> list[RequestOutput]:
        """Wait for news: the outputs that changed since the last take, or raise the error."""
        await self._ready.wait()
        self._ready.clear()
        if self._error is not None:
            raise self._error
        items = list(self._latest.values())
        self._latest.clear()
        return items
