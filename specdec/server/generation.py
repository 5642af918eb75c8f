"""Generation: the engine requests behind one HTTP request, from admission to cleanup.

``admit`` takes admission slots, ``submit`` hands the prompts to the engine thread,
``updates`` yields the outputs that changed (a Mailbox keeps only the latest of each), and ``close`` — always called, however the HTTP request ends — aborts whatever is
unfinished and returns the slots. Event-loop thread only.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from specdec.lora.request import LoRARequest
from specdec.outputs import RequestOutput
from specdec.sampling_params import SamplingParams
from specdec.server.admission import Admission, Closed, QueueFull
from specdec.server.async_engine import AsyncEngine, EngineDead, EngineRequest
from specdec.server.mailbox import Mailbox
from specdec.server.protocol import APIError
from specdec.server.structured import engine_error_param


class Generation:
    def __init__(self, engine: AsyncEngine, admission: Admission, base_id: str, prompt_ids: list[list[int]],
                 prompt_texts: list[str | None], params: SamplingParams, constraint_field: str | None = None,
                 lora_request: LoRARequest | None = None):
        self.engine = engine
        self.constraint_field = constraint_field  # names the field of an engine error about the grammar
        self.admission = admission
        self.params = params
        self.requests = [EngineRequest(f"{base_id}-{i}", ids, params, text, lora_request)
                         for i, (ids, text) in enumerate(zip(prompt_ids, prompt_texts))]
        self.index = {r.request_id: i for i, r in enumerate(self.requests)}
        self.latest: list[RequestOutput | None] = [None] * len(self.requests)
        self.unfinished = set(self.index)
        self.num_slots = len(self.requests) * params.n
        self.num_prompt_tokens = sum(len(ids) for ids in prompt_ids)
        self.arrival = time.monotonic()  # TTFT counts the time spent waiting for admission too
        self._sink = Mailbox()
        self._admitted = False
        self._submitted = False
        self._closed = False

    async def admit(self) -> None:
        if self._admitted:
            return
        try:
            await self.admission.acquire(self.num_slots)
        except QueueFull as e:
            raise APIError(503, str(e), code="queue_full") from None
        except Closed as e:
            raise APIError(503, str(e), code="shutting_down") from None
        except ValueError as e:
            raise APIError(400, str(e), param="n") from None
        self._admitted = True

    def submit(self) -> None:
        try:
            self.engine.submit(self.requests, self._sink, self.arrival)
        except EngineDead as e:
            raise APIError(503, str(e), code="engine_unavailable") from None
        self._submitted = True

    async def start(self) -> None:
        await self.admit()
        if not self._submitted:
            self.submit()

    async def updates(self) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        """Yield ``[(prompt_index, latest cumulative output)]`` for the prompts that advanced."""
        while self.unfinished:
            try:
                items = await self._sink.take()
            except Exception as e:  # noqa: BLE001 - the engine thread's verdict on this request
                raise _as_api_error(e, self.constraint_field) from None
            changed: dict[int, RequestOutput] = {}
            for item in items:
                i = self.index[item.request_id]
                self.latest[i] = changed[i] = item
                if item.finished:
                    self.unfinished.discard(item.request_id)
            yield sorted(changed.items())

    def close(self) -> None:
        """Abort the unfinished engine requests and free the admission slots (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._submitted and self.unfinished:
            self.engine.abort(sorted(self.unfinished))
        if self._admitted:
            self.admission.release(self.num_slots)


def _as_api_error(e: BaseException, constraint_field: str | None = None) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, ValueError):
        return APIError(400, str(e), param=engine_error_param(str(e), constraint_field))
    if isinstance(e, EngineDead):
        return APIError(503, str(e), code="engine_unavailable")
    return APIError(500, f"internal error: {e}", code="engine_step_failed")
