"""AsyncEngine: the synchronous EngineCore driven by one background thread.

The event loop never touches the engine. It puts commands (add / abort / stop) on a
thread-safe queue; the engine thread applies every queued command, runs one step, and
hands that step's outputs back to the loop in one ``call_soon_threadsafe`` batch, each to
the ``Mailbox`` (the "sink") of the HTTP request that submitted it. An abort is applied
before the next step, so a departed client's KV blocks are free within one step.

A step that raises fails only the requests it can be pinned on (step_isolation.py); one it
cannot be pinned on fails the batch, and ``MAX_UNATTRIBUTED_FAILURES`` of those in a row,
or any error outside a step, end the thread: every request fails, ``on_death`` is called
(the server then exits non-zero, for its supervisor to restart it) and ``is_alive`` is False.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from specdec.engine.engine_core import EngineCore
from specdec.lora.request import LoRARequest
from specdec.outputs import RequestOutput
from specdec.sampling_params import SamplingParams
from specdec.server.mailbox import Mailbox
from specdec.server.memory import release_free_memory
from specdec.server.metrics import ServerMetrics
from specdec.server.step_isolation import StepIsolation

MAX_UNATTRIBUTED_FAILURES = 3
logger = logging.getLogger("specdec.server")


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    lora_request: LoRARequest | None = None


@dataclass
class _Live:
    """Engine-thread bookkeeping for one submitted request."""
    sink: Mailbox
    request: EngineRequest
    arrival: float
    num_tokens: list[int]  # per completion, for latency metrics
    last_delivery: float | None = None
    prompt_len: int = 0


@dataclass
class _Command:
    kind: str  # "add" | "abort" | "fail_all" | "stop"
    requests: list[EngineRequest] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)
    sink: Mailbox | None = None
    arrival: float = 0.0
    error: BaseException | None = None


class EngineDead(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, engine: EngineCore, metrics: ServerMetrics | None = None, on_death=None):
        self.engine = engine
        self.metrics = metrics
        self.on_death = on_death  # called (engine thread) once the thread is about to die
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}  # engine thread only
        self._fresh: list[str] = []  # added since the last good step (engine thread only)
        self._num_unattributed = 0
        self._isolation = StepIsolation(engine.step, engine.has_unfinished_requests, self._readd,
                                        engine.abort_request, self._handle_outputs, self._fail_offender)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.snapshot: dict = {}  # engine.get_metrics() after the last step; replaced whole, never mutated
        self.error: BaseException | None = None  # set if the engine thread died

    # ---- event-loop side ----
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._publish_snapshot()
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def submit(self, requests: list[EngineRequest], sink: Mailbox, arrival: float | None = None) -> None:
        """``arrival`` (time.monotonic()): when the HTTP request came in; latency metrics count from it."""
        if not self.is_alive:
            raise EngineDead(f"the engine is not running: {self.error!r}")
        self._commands.put(_Command("add", requests=requests, sink=sink, arrival=arrival or time.monotonic()))

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self._commands.put(_Command("abort", request_ids=list(request_ids)))

    def fail_all(self, error: BaseException) -> None:
        """Abort every running request, each failing with ``error`` (the shutdown deadline)."""
        self._commands.put(_Command("fail_all", error=error))

    def stop(self, timeout: float | None = 30.0) -> None:
        """Abort whatever is still running and join the engine thread."""
        if self._thread is None:
            return
        self._commands.put(_Command("stop"))
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("engine thread did not stop within %.0f s", timeout)

    # ---- engine thread ----
    def _run(self) -> None:
        busy = False  # since the last time the engine went idle
        try:
            while True:
                idle = not self.engine.has_unfinished_requests()
                if idle and busy:
                    release_free_memory()  # memory.py: RSS stays level from one burst to the next
                busy = not idle
                if not self._apply_commands(block=idle):
                    break
                if self.engine.has_unfinished_requests() and self._step():
                    continue  # the step published the snapshot before its outputs left
                self._publish_snapshot()
        except BaseException as e:  # a bug: fail every request loudly rather than hang them
            logger.exception("engine thread died")
            self.error = e
            self._fail_all(EngineDead(f"engine failure: {e!r}"), abort=True)
            if self.on_death is not None:
                self.on_death()

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one if ``block``); False once told to stop."""
        try:
            cmd = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd.kind == "stop":
                self._abort(list(self._live))
                self._fail_all(EngineDead("server is shutting down"))
                self._publish_snapshot()
                return False
            if cmd.kind == "add":
                self._add(cmd)
            elif cmd.kind == "fail_all":
                self._fail_all(cmd.error, abort=True, reason="abort")
            else:
                self._abort(cmd.request_ids)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, cmd: _Command) -> None:
        added = []
        for req in cmd.requests:
            taken = req.request_id in self.engine.groups  # never with uuid ids; then it is not ours to abort
            try:
                self.engine.add_request(req.request_id, req.prompt_token_ids, req.params, prompt=req.prompt,
                                        lora_request=req.lora_request)
            except Exception as e:  # noqa: BLE001 - all-or-nothing: one bad prompt fails its HTTP request only
                if not isinstance(e, ValueError):
                    logger.exception("add_request(%s) failed", req.request_id)
                    e = RuntimeError(f"could not add the request: {e!r}")
                try:
                    self.engine.abort_request(added if taken else added + [req.request_id])  # a half-added group
                except Exception:  # noqa: BLE001
                    logger.exception("cleaning up after a failed add also failed")
                for rid in added:
                    self._live.pop(rid, None)
                self._deliver([(cmd.sink, e)])
                return
            added.append(req.request_id)
            self._live[req.request_id] = _Live(cmd.sink, req, cmd.arrival, [0] * req.params.n,
                                               prompt_len=len(req.prompt_token_ids))
        self._fresh += added

    def _readd(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            req = self._live[rid].request
            self.engine.add_request(rid, req.prompt_token_ids, req.params, prompt=req.prompt,
                                    lora_request=req.lora_request)

    def _abort(self, request_ids: list[str]) -> None:
        live = [rid for rid in request_ids if rid in self._live]
        self.engine.abort_request(live)
        for rid in live:
            del self._live[rid]
            if self.metrics:
                self.metrics.request_finished("abort")

    def _step(self) -> bool:
        """One engine step; True if it completed (its outputs delivered, the snapshot published)."""
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - find the offender, fail it alone, keep serving
            logger.exception("engine step failed; isolating the request(s) that caused it")
            suspects = [rid for rid in self._fresh if rid in self._live]
            self._fresh = []
            found, controlled = self._isolation.isolate(suspects)
            if found and controlled:
                self._num_unattributed = 0
                return False
            self._num_unattributed += 1  # no good step to compare with: maybe the engine itself
            if self._num_unattributed >= MAX_UNATTRIBUTED_FAILURES:
                raise RuntimeError(f"{self._num_unattributed} engine steps in a row failed and could not be "
                                   f"pinned on a request; the last: {e!r}") from e
            if not found:
                self._fail_all(RuntimeError(f"engine step failed: {e!r}"), abort=True, reason="failed")
            return False
        self._fresh = []
        self._num_unattributed = 0
        self._handle_outputs(outputs)
        return True

    def _fail_offender(self, request_id: str, error: BaseException) -> None:
        """Fail the HTTP request that ``request_id`` belongs to (all its prompts), and only it."""
        sink = self._live[request_id].sink
        siblings = [rid for rid, live in self._live.items() if live.sink is sink]
        self.engine.abort_request(siblings)
        for rid in siblings:
            del self._live[rid]
            if self.metrics:
                self.metrics.request_finished("failed")
        self._deliver([(sink, RuntimeError(f"this request made the engine step fail: {error!r}"))])

    def _handle_outputs(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        batch = []
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue  # aborted after this step was scheduled
            self._observe(live, out, now)
            batch.append((live.sink, out))
            if out.finished:
                del self._live[out.request_id]
        # before the outputs leave: a client that reads /metrics once its answer arrives sees this step
        self._publish_snapshot()
        self._deliver(batch)

    def _observe(self, live: _Live, out: RequestOutput, now: float) -> None:
        m = self.metrics
        if m is None:
            return
        num_new = 0
        for c in out.outputs:
            num_new += len(c.token_ids) - live.num_tokens[c.index]
            live.num_tokens[c.index] = len(c.token_ids)
        if live.last_delivery is None and num_new:
            m.ttft.observe(now - live.arrival)
            m.prompt_tokens.inc(live.prompt_len)
        m.observe_tokens(num_new, None if live.last_delivery is None else now - live.last_delivery)
        if num_new:
            live.last_delivery = now
        if out.finished:
            m.e2e.observe(now - live.arrival)
            m.request_finished(out.outputs[0].finish_reason or "abort")

    def _fail_all(self, error: BaseException, abort: bool = False, reason: str | None = "failed") -> None:
        """Fail every live request with ``error``; ``reason`` is what /metrics counts them as."""
        if abort:
            try:
                self.engine.abort_request(list(self._live))
            except Exception:  # noqa: BLE001
                logger.exception("abort after a failed step also failed")
        if self.metrics and reason:
            for _ in self._live:
                self.metrics.request_finished(reason)
        batch = [(live.sink, error) for live in self._live.values()]
        self._live.clear()
        self._deliver(batch)

    def _deliver(self, batch: list) -> None:
        if not batch or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _publish_snapshot(self) -> None:
        snap = self.engine.get_metrics()
        snap["num_in_flight"] = len(self._live)
        self.snapshot = snap


def _put_all(batch: list) -> None:
    for sink, item in batch:
        sink.put(item)
