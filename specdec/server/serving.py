"""OpenAI completions and chat completions on top of AsyncEngine.

Both endpoints run one pipeline: prepare (parse, validate, template, tokenize: prepare.py,
on a TokenizerPool thread) -> admit -> submit -> answer, as one JSON body or as server-sent
events. A stream is admitted before its 200, so a full queue is a status, not an event. A
client that goes away is noticed (non-streaming: an ``http.disconnect`` on the receive
channel; streaming: the response task is cancelled) and its engine requests are aborted; so
is a stream whose client stops reading for ``write_timeout`` seconds.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from specdec.server.admission import Admission
from specdec.server.async_engine import AsyncEngine
from specdec.server.generation import Generation
from specdec.server.json_response import StrictJSONResponse, dumps_strict
from specdec.server.prepare import Prepared, Preparer
from specdec.server.protocol import APIError
from specdec.server.responses import (
    ChoiceDelta,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    holdback_for,
    usage,
)
from specdec.server.tokenizer_pool import TokenizerPool, own_copy
from specdec.tool_parsers import ToolCallStream, new_call_id

logger = logging.getLogger("specdec.server")


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, admission: Admission, preparer: Preparer, pool: TokenizerPool,
                 write_timeout: float = 30.0):
        self.engine = engine
        self.admission = admission
        self.preparer = preparer
        self.pool = pool
        self.write_timeout = write_timeout
        self.model_names = preparer.model_names
        self.tokenizer = own_copy(engine.engine.tokenizer)  # event-loop thread: echo and logprob texts
        self.token_text = TokenText(self.tokenizer)
        self.draining = False  # set at shutdown: new requests are a 503

    def _check_open(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")

    async def _prepare(self, fn, body: bytes) -> Prepared:
        self._check_open()
        prepared = await self.pool.run(fn, body)
        self._check_open()  # a shutdown may have begun while it was prepared
        return prepared

    async def _respond(self, raw: Request, gen: Generation, stream: bool, body, chunks) -> Response:
        """``body(gen)``: the JSON answer; ``chunks(gen)``: the SSE event iterator."""
        if not stream:
            try:
                return await _until_done_or_disconnected(raw, gen, body)
            finally:
                gen.close()
        try:  # admitted before the 200: a full queue is a 503 status, not an in-band event
            admitted = await _unless_disconnected(raw, gen.start())
        except BaseException:
            gen.close()
            raise
        if not admitted:
            gen.close()
            return Response(status_code=499)  # nobody reads this: the client left while waiting
        return _GenerationStream(_sse(gen, chunks), gen, self.write_timeout)

    # ---- /v1/completions ----
    async def completions(self, body: bytes, raw: Request) -> Response:
        prep = await self._prepare(self.preparer.completion, body)
        req, model, params, ids, texts = prep.req, prep.model, prep.params, prep.prompt_ids, prep.prompt_texts
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        gen = Generation(self.engine, self.admission, rid, ids, texts, params, prep.constraint_field,
                         prep.lora_request)
        n, top = params.n, params.logprobs or 0
        head = {"id": rid, "object": "text_completion", "created": created, "model": model}

        def echo_text(i: int) -> str:
            return (texts[i] if texts[i] is not None else self.tokenizer.decode(ids[i])) if req.echo else ""

        async def body(gen: Generation) -> dict:
            async for _ in gen.updates():
                pass
            choices = []
            for i, out in enumerate(gen.latest):
                for c in out.outputs:
                    choice = {"index": i * n + c.index, "text": echo_text(i) + c.text, "logprobs": None,
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                    if c.logprobs is not None:
                        choice["logprobs"] = completion_logprobs(c.token_ids, c.logprobs, top, self.token_text, 0)
                    if req.return_token_ids:
                        choice["token_ids"] = c.token_ids
                    choices.append(choice)
            return {**head, "choices": choices, "usage": usage(gen.latest, gen.num_prompt_tokens)}

        async def chunks(gen: Generation):
            trackers = {}
            if req.echo:
                for i in range(len(ids)):
                    for j in range(n):
                        yield self._chunk(head, req, {"index": i * n + j, "text": echo_text(i), "logprobs": None,
                                                      "finish_reason": None})
            async for changed in gen.updates():
                for i, out in changed:
                    for c in out.outputs:
                        t = trackers.setdefault((i, c.index), ChoiceDelta(holdback_for(params.stop)))
                        offset = len(t.sent_text)
                        d = t.advance(c)
                        if d.is_empty:
                            continue
                        choice = {"index": i * n + c.index, "text": d.text, "logprobs": None,
                                  "finish_reason": d.finish_reason}
                        if d.finish_reason:
                            choice["stop_reason"] = d.stop_reason
                        if d.logprobs is not None:
                            choice["logprobs"] = completion_logprobs(d.token_ids, d.logprobs, top, self.token_text,
                                                                     offset)
                        if req.return_token_ids:
                            choice["token_ids"] = d.token_ids
                        yield self._chunk(head, req, choice)
            if req.include_usage:
                yield {**head, "choices": [], "usage": usage(gen.latest, gen.num_prompt_tokens)}

        return await self._respond(raw, gen, req.stream, body, chunks)

    # ---- /v1/chat/completions ----
    async def chat(self, body: bytes, raw: Request) -> Response:
        prep = await self._prepare(self.preparer.chat, body)
        req, model, params, ids = prep.req, prep.model, prep.params, prep.prompt_ids[0]
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        gen = Generation(self.engine, self.admission, rid, [ids], [None], params, prep.constraint_field,
                         prep.lora_request)
        top = params.logprobs or 0
        head = {"id": rid, "object": "chat.completion", "created": created, "model": model}
        parser = prep.tool_parser
        max_calls = None if req.parallel_tool_calls else 1  # "auto" cannot enforce it: later calls are dropped

        async def body(gen: Generation) -> dict:
            async for _ in gen.updates():
                pass
            choices = []
            for c in gen.latest[0].outputs:
                message, finish = {"role": "assistant", "content": c.text}, c.finish_reason
                if parser is not None:  # content stripped, as a stream sends it (it holds back blanks)
                    parsed = parser.parse(c.text)
                    message["content"] = parsed.content if parsed.tool_calls else parsed.content or ""
                    if parsed.tool_calls:
                        message["tool_calls"] = [call.as_openai(new_call_id()) for call in parsed.tool_calls[:max_calls]]
                        finish = _tool_finish(finish)
                choice = {"index": c.index, "message": message,
                          "logprobs": None, "finish_reason": finish, "stop_reason": c.stop_reason}
                if c.logprobs is not None:
                    choice["logprobs"] = chat_logprobs(c.token_ids, c.logprobs, top, self.token_text)
                if req.return_token_ids:
                    choice["token_ids"] = c.token_ids
                choices.append(choice)
            return {**head, "choices": choices, "usage": usage(gen.latest, gen.num_prompt_tokens)}

        async def chunks(gen: Generation):
            chunk_head = {**head, "object": "chat.completion.chunk"}
            for j in range(params.n):
                yield self._chunk(chunk_head, req, {"index": j, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None})
            trackers, tool_streams = {}, {}
            async for changed in gen.updates():
                for _, out in changed:
                    for c in out.outputs:
                        t = trackers.setdefault(c.index, ChoiceDelta(holdback_for(params.stop)))
                        d = t.advance(c)
                        if d.is_empty:
                            continue
                        finish = d.finish_reason
                        if parser is None:
                            delta = {"content": d.text} if d.text else {}
                        else:  # the parser sees the text sent so far, so calls never leak into content
                            stream = tool_streams.setdefault(c.index, ToolCallStream(parser, max_calls))
                            delta = stream.update(t.sent_text, final=finish is not None)
                            if stream.num_calls:
                                finish = _tool_finish(finish)
                            if not delta and finish is None and d.logprobs is None and not req.return_token_ids:
                                continue
                        choice = {"index": c.index, "delta": delta, "logprobs": None, "finish_reason": finish}
                        if d.finish_reason:
                            choice["stop_reason"] = d.stop_reason
                        if d.logprobs is not None:
                            choice["logprobs"] = chat_logprobs(d.token_ids, d.logprobs, top, self.token_text)
                        if req.return_token_ids:
                            choice["token_ids"] = d.token_ids
                        yield self._chunk(chunk_head, req, choice)
            if req.include_usage:
                yield {**chunk_head, "choices": [], "usage": usage(gen.latest, gen.num_prompt_tokens)}

        return await self._respond(raw, gen, req.stream, body, chunks)

    @staticmethod
    def _chunk(head: dict, req, choice: dict) -> dict:
        chunk = {**head, "choices": [choice]}
        if req.include_usage:
            chunk["usage"] = None
        return chunk


def _tool_finish(finish_reason: str | None) -> str | None:
    """A choice that called tools and ended on its own (not cut by max_tokens) ends in "tool_calls"."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


async def _until_done_or_disconnected(raw: Request, gen: Generation, body) -> Response:
    async def run() -> dict:
        await gen.start()
        return await body(gen)

    work = asyncio.ensure_future(run())
    gone = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            work.cancel()
        gone.cancel()
    if not work.done() or work.cancelled():
        return Response(status_code=499)  # nobody reads this: the client is gone
    return StrictJSONResponse(work.result())  # re-raises the work's APIError, if any


async def _unless_disconnected(raw: Request, work) -> bool:
    """Await ``work``; False (and ``work`` cancelled) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        gone.cancel()
    if task.cancelled():
        return False
    task.result()  # re-raises an admission error
    return True


async def _wait_for_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def _sse(gen: Generation, chunks):
    try:
        await gen.start()
        async for chunk in chunks(gen):
            yield f"data: {dumps_strict(chunk)}\n\n"
    except APIError as e:  # the status line is already sent: report in-band, as OpenAI does
        yield f"data: {dumps_strict(e.body())}\n\n"
    yield "data: [DONE]\n\n"


class _ClientStalled(Exception):
    pass


class _GenerationStream(StreamingResponse):
    """An SSE response that closes its Generation however the response ends, even if the
    body iterator never started (client gone before the first byte), and gives up on a
    client that has not taken a write for ``write_timeout`` seconds (its socket buffers are
    full): the engine request is aborted and its KV blocks and admission slots freed."""

    def __init__(self, content, gen: Generation, write_timeout: float):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._gen = gen
        self._write_timeout = write_timeout

    async def __call__(self, scope, receive, send) -> None:
        async def timed_send(message) -> None:
            try:
                await asyncio.wait_for(send(message), self._write_timeout)
            except asyncio.TimeoutError:
                raise _ClientStalled from None

        try:
            await super().__call__(scope, receive, timed_send)
        except _ClientStalled:
            logger.warning("a client stopped reading its stream for %.0f s; aborting its request", self._write_timeout)
        finally:
            self._gen.close()
