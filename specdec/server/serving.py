"""OpenAI completions and chat completions on top of AsyncEngine.

Both endpoints run one pipeline: validate -> tokenize (the front end's own tokenizer copy;
HF fast tokenizers are not safe to share with the engine thread) -> admit -> submit ->
answer, as one JSON body or as server-sent events. A client that goes away is noticed
(non-streaming: an ``http.disconnect`` on the receive channel; streaming: the response
task is cancelled) and its engine requests are aborted.
"""
from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from specdec.server.admission import Admission
from specdec.server.async_engine import AsyncEngine
from specdec.server.generation import Generation
from specdec.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from specdec.server.responses import ChoiceDelta, TokenText, chat_logprobs, completion_logprobs, holdback_for, usage

logger = logging.getLogger("specdec.server")


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, admission: Admission, model_names: list[str]):
        self.engine = engine
        self.admission = admission
        self.model_names = model_names
        self.tokenizer = _own_copy(engine.engine.tokenizer)
        self.token_text = TokenText(self.tokenizer)

    # ---- shared pipeline ----
    def check_model(self, name: str | None) -> str:
        if name is not None and name not in self.model_names:
            raise APIError(404, f"the model '{name}' does not exist; this server serves {self.model_names}",
                           param="model", code="model_not_found")
        return self.model_names[0]

    def validate_prompt(self, ids: list[int], param: str) -> None:
        try:
            self.engine.engine.validate_prompt(ids)  # reads only immutable engine fields
        except ValueError as e:
            raise APIError(400, str(e), param=param) from None

    async def _respond(self, raw: Request, gen: Generation, stream: bool, body, chunks) -> Response:
        """``body(gen)``: the JSON answer; ``chunks(gen)``: the SSE event iterator."""
        if not stream:
            try:
                return await _until_done_or_disconnected(raw, gen, body)
            finally:
                gen.close()
        try:
            if self.admission.policy == "reject":
                await gen.start()  # a full queue is a 503 status, before any event is sent
        except BaseException:
            gen.close()
            raise
        return _GenerationStream(_sse(gen, chunks), gen)

    # ---- /v1/completions ----
    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        model = self.check_model(req.model)
        params = req.to_sampling_params()
        texts, ids = [], []
        for p in req.prompts():
            if isinstance(p, str):
                texts.append(p)
                ids.append(self.tokenizer.encode(p))
            else:
                texts.append(None)
                ids.append(list(p))
        for prompt_ids in ids:
            self.validate_prompt(prompt_ids, "prompt")
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        gen = Generation(self.engine, self.admission, rid, ids, texts, params)
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
    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        model = self.check_model(req.model)
        params = req.to_sampling_params()
        ids = self._apply_chat_template(req)
        self.validate_prompt(ids, "messages")
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        gen = Generation(self.engine, self.admission, rid, [ids], [None], params)
        top = params.logprobs or 0
        head = {"id": rid, "object": "chat.completion", "created": created, "model": model}

        async def body(gen: Generation) -> dict:
            async for _ in gen.updates():
                pass
            choices = []
            for c in gen.latest[0].outputs:
                choice = {"index": c.index, "message": {"role": "assistant", "content": c.text},
                          "logprobs": None, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
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
            trackers = {}
            async for changed in gen.updates():
                for _, out in changed:
                    for c in out.outputs:
                        t = trackers.setdefault(c.index, ChoiceDelta(holdback_for(params.stop)))
                        d = t.advance(c)
                        if d.is_empty:
                            continue
                        choice = {"index": c.index, "delta": {"content": d.text} if d.text else {},
                                  "logprobs": None, "finish_reason": d.finish_reason}
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

    def _apply_chat_template(self, req: ChatCompletionRequest) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions", param="messages")
        try:
            ids = self.tokenizer.apply_chat_template(req.template_messages(), tokenize=True,
                                                     add_generation_prompt=req.add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - template errors (e.g. role order) are the client's
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    @staticmethod
    def _chunk(head: dict, req, choice: dict) -> dict:
        chunk = {**head, "choices": [choice]}
        if req.include_usage:
            chunk["usage"] = None
        return chunk


def _own_copy(tokenizer):
    try:
        return copy.deepcopy(tokenizer)
    except Exception:  # noqa: BLE001 - share it; encode/decode are read-mostly
        logger.warning("could not copy the tokenizer; the front end shares the engine's")
        return tokenizer


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
    return JSONResponse(work.result())  # re-raises the work's APIError, if any


async def _wait_for_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def _sse(gen: Generation, chunks):
    try:
        await gen.start()
        async for chunk in chunks(gen):
            yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
    except APIError as e:  # the status line is already sent: report in-band, as OpenAI does
        yield f"data: {json.dumps(e.body())}\n\n"
    yield "data: [DONE]\n\n"


class _GenerationStream(StreamingResponse):
    """An SSE response that closes its Generation however the response ends, even if the
    body iterator never started (client gone before the first byte)."""

    def __init__(self, content, gen: Generation):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._gen = gen

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._gen.close()
