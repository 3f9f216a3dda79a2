"""``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``, ``/v1/models``."""

from __future__ import annotations

import base64
import secrets
import struct
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from aiohttp import web

from supervisor.errors import ApiError
from supervisor.httputil import SseWriter, decode_body, json_response
from supervisor.keys import POOL
from supervisor.openai_types import ChatRequest, CompletionRequest, EmbeddingRequest
from worker.protocol import Delta, Done

_FINISH = {"stop": "stop", "length": "length", "cancelled": "stop"}


def _usage(done: Done) -> dict[str, Any]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    }


class _Shape:
    """What differs between chat and text completions in the reply objects."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())

    def _wrap(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices}

    def whole(self, text: str, done: Done) -> dict[str, Any]:
        reason = _FINISH[done.finish_reason]
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": reason, "logprobs": None}
            body = self._wrap("chat.completion", [choice])
        else:
            body = self._wrap("text_completion", [
                {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}])
        body["usage"] = _usage(done)
        return body

    def chunk(self, text: str | None, finish: str | None = None, first: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            return self._wrap("chat.completion.chunk", [choice])
        return self._wrap("text_completion",
                          [{"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}])

    def usage_chunk(self, done: Done) -> dict[str, Any]:
        body = self._wrap("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = _usage(done)
        return body


async def _collect(stream: AsyncGenerator[Delta | Done, None]) -> tuple[str, Done]:
    parts: list[str] = []
    async with aclosing(stream) as events:
        async for ev in events:
            if isinstance(ev, Delta):
                parts.append(ev.text)
            else:
                return "".join(parts), ev
    raise RuntimeError("generation ended without a Done event")


async def _stream(request: web.Request, shape: _Shape, stream: AsyncGenerator[Delta | Done, None],
                  include_usage: bool) -> web.StreamResponse:
    async with aclosing(stream) as events:
        # Pull the first event before committing to a 200: queue-full, unknown
        # model and lease refusals still become proper HTTP errors.
        first = await anext(events)
        sse = await SseWriter.start(request)
        if shape.chat:
            await sse.data(shape.chunk("", first=True))
        try:
            ev: Delta | Done = first
            while True:
                if isinstance(ev, Done):
                    await sse.data(shape.chunk(None if shape.chat else "", _FINISH[ev.finish_reason]))
                    if include_usage:
                        await sse.data(shape.usage_chunk(ev))
                    await sse.raw(b"data: [DONE]\n\n")
                    break
                await sse.data(shape.chunk(ev.text))
                ev = await anext(events)
        except ApiError as err:
            # Mid-stream failure: a final error object, then the stream ends.
            await sse.data(err.body())
        await sse.close()
        return sse.response


async def chat_completions(request: web.Request) -> web.StreamResponse:
    req = await decode_body(request, ChatRequest)
    messages = req.chat_messages()
    params = req.chat_sampling()
    pool = request.app[POOL]
    stream = pool.generate(req.model, messages=messages, tools=req.tools, params=params,
                           request_id=request.get("request_id", ""), keep_alive=req.keep_alive_s())
    shape = _Shape(True, req.model)
    if req.stream:
        return await _stream(request, shape, stream, req.include_usage)
    text, done = await _collect(stream)
    return json_response(shape.whole(text, done))


async def completions(request: web.Request) -> web.StreamResponse:
    req = await decode_body(request, CompletionRequest)
    prompt = req.prompt_text()
    params = req.sampling()
    if params.max_tokens is None:
        params.max_tokens = 16  # OpenAI's default for legacy completions
    stream = request.app[POOL].generate(req.model, prompt=prompt, params=params,
                                        request_id=request.get("request_id", ""),
                                        keep_alive=req.keep_alive_s())
    shape = _Shape(False, req.model)
    if req.stream:
        return await _stream(request, shape, stream, req.include_usage)
    text, done = await _collect(stream)
    if req.echo:
        text = prompt + text
    return json_response(shape.whole(text, done))


async def embeddings(request: web.Request) -> web.Response:
    req = await decode_body(request, EmbeddingRequest)
    result = await request.app[POOL].embed(req.model, req.inputs())
    data = []
    for i, vec in enumerate(result.vectors):
        emb: list[float] | str = vec
        if req.encoding_format == "base64":
            emb = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    return json_response({"object": "list", "data": data, "model": req.model,
                          "usage": {"prompt_tokens": result.prompt_tokens,
                                    "total_tokens": result.prompt_tokens}})


async def list_models(request: web.Request) -> web.Response:
    pool = request.app[POOL]
    data = []
    for entry in pool.models.entries():
        status = pool.status(entry.id)
        state = status["state"] if status else ("unloaded" if entry.usable else "unusable")
        reason = status["reason"] if status else entry.reason
        data.append({"id": entry.id, "object": "model", "created": int(entry.mtime),
                     "owned_by": "gpuvisor", "state": state, "reason": reason})
    return json_response({"object": "list", "data": data})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/embeddings", embeddings)
