"""``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``, ``/v1/models``.

Chat output is planned and parsed the way the Responses API does it: offered
tools may be forced with a grammar, and when the request offers tools or the
template thinks, calls become ``tool_calls`` and ``<think>`` text becomes
``reasoning_content``. Otherwise the model's text passes through unchanged.
"""

from __future__ import annotations

import base64
import secrets
import struct
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from aiohttp import web

from supervisor.errors import ApiError, BadRequest
from supervisor.httputil import SseWriter, decode_body, json_response
from supervisor.keys import POOL
from supervisor.openai_types import ChatRequest, CompletionRequest, EmbeddingRequest
from supervisor.responses.items import new_id
from supervisor.responses.parse import OutputParser, Piece, Reasoning, Text, ToolCall
from supervisor.responses.profile import profile_for
from supervisor.responses.runner import Plan, tool_plan
from worker.protocol import Delta, Done

_FINISH = {"stop": "stop", "length": "length", "cancelled": "stop"}


def _usage(done: Done, reasoning_tokens: int = 0) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    }
    if reasoning_tokens:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return usage


def _finish_reason(done: Done, called: bool) -> str:
    reason = _FINISH[done.finish_reason]
    # A call cut by the token limit stays "length": its arguments may be incomplete.
    return "tool_calls" if called and reason == "stop" else reason


def tool_call(call: ToolCall, call_id: str) -> dict[str, Any]:
    """A parsed call in the chat-completions shape."""
    return {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def chat_message(pieces: list[Piece]) -> dict[str, Any]:
    """The assistant message of a whole reply; content is null beside calls and no text."""
    text = "".join(p.text for p in pieces if isinstance(p, Text))
    reasoning = "".join(p.text for p in pieces if isinstance(p, Reasoning))
    calls = [tool_call(p, new_id("call")) for p in pieces if isinstance(p, ToolCall)]
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message


def chat_delta(piece: Piece, call_index: int) -> dict[str, Any]:
    """One piece as a streamed ``delta``; ``call_index`` numbers the calls of the reply."""
    if isinstance(piece, ToolCall):
        # Whole calls only: the parser yields a call once its arguments are complete.
        return {"tool_calls": [{"index": call_index, **tool_call(piece, new_id("call"))}]}
    if isinstance(piece, Reasoning):
        return {"reasoning_content": piece.text}
    return {"content": piece.text}


class Reply:
    """Model text -> pieces: parsed when the plan calls for it, else passed through."""

    def __init__(self, parser: OutputParser | None = None, forced_call: bool = False) -> None:
        self._parser = parser
        self.forced_call = forced_call
        self.reasoning_tokens = 0

    @classmethod
    def of(cls, plan: Plan) -> Reply:
        parses = bool(plan.tool_names) or plan.profile.thinks
        return cls(plan.parser() if parses else None, forced_call=plan.params.grammar is not None)

    def feed(self, delta: Delta) -> list[Piece]:
        if self._parser is None:
            return [Text(delta.text)]
        if self._parser.in_reasoning:
            self.reasoning_tokens += delta.n_tokens
        return self._parser.feed(delta.text)

    def finish(self) -> list[Piece]:
        return self._parser.finish() if self._parser is not None else []

    def blamed(self, exc: BadRequest) -> BadRequest:
        """The pool blames a bad grammar on response_format; a forced call's is tool_choice's."""
        if self.forced_call and exc.param == "response_format":
            return BadRequest(exc.message, param="tool_choice", code=exc.code)
        return exc


class _Shape:
    """What differs between chat and text completions in the reply objects."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.calls = 0  # tool calls streamed so far, each chunk naming its index

    def _wrap(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices}

    def whole(self, pieces: list[Piece], done: Done, reasoning_tokens: int = 0) -> dict[str, Any]:
        if self.chat:
            message = chat_message(pieces)
            choice = {"index": 0, "message": message, "finish_reason": _finish_reason(done, "tool_calls" in message),
                      "logprobs": None}
            body = self._wrap("chat.completion", [choice])
        else:
            text = "".join(p.text for p in pieces if isinstance(p, Text))
            body = self._wrap("text_completion", [
                {"index": 0, "text": text, "finish_reason": _FINISH[done.finish_reason], "logprobs": None}])
        body["usage"] = _usage(done, reasoning_tokens)
        return body

    def chunk(self, piece: Piece | None, finish: str | None = None, first: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if piece is not None:
                delta.update(chat_delta(piece, self.calls))
                if isinstance(piece, ToolCall):
                    self.calls += 1
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            return self._wrap("chat.completion.chunk", [choice])
        text = piece.text if isinstance(piece, Text) else ""
        return self._wrap("text_completion",
                          [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}])

    def final_chunk(self, done: Done) -> dict[str, Any]:
        return self.chunk(None, _finish_reason(done, self.calls > 0))

    def usage_chunk(self, done: Done, reasoning_tokens: int = 0) -> dict[str, Any]:
        body = self._wrap("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = _usage(done, reasoning_tokens)
        return body


async def _next(events: AsyncGenerator[Delta | Done, None], reply: Reply) -> Delta | Done:
    try:
        return await anext(events)
    except StopAsyncIteration:
        raise RuntimeError("generation ended without a Done event") from None
    except BadRequest as exc:
        raise reply.blamed(exc) from exc


async def _collect(stream: AsyncGenerator[Delta | Done, None], reply: Reply) -> tuple[list[Piece], Done]:
    pieces: list[Piece] = []
    async with aclosing(stream) as events:
        while True:
            ev = await _next(events, reply)
            if isinstance(ev, Done):
                return pieces + reply.finish(), ev
            pieces += reply.feed(ev)


async def _stream(request: web.Request, shape: _Shape, stream: AsyncGenerator[Delta | Done, None],
                  reply: Reply, include_usage: bool) -> web.StreamResponse:
    async with aclosing(stream) as events:
        # Pull the first event before committing to a 200: queue-full, unknown
        # model and lease refusals still become proper HTTP errors.
        first = await _next(events, reply)
        sse = await SseWriter.start(request)
        if shape.chat:
            # A forced call has no text: its content stays null, as in a whole reply.
            await sse.data(shape.chunk(None if reply.forced_call else Text(""), first=True))
        try:
            ev: Delta | Done = first
            while True:
                if isinstance(ev, Done):
                    for piece in reply.finish():
                        await sse.data(shape.chunk(piece))
                    await sse.data(shape.final_chunk(ev))
                    if include_usage:
                        await sse.data(shape.usage_chunk(ev, reply.reasoning_tokens))
                    await sse.raw(b"data: [DONE]\n\n")
                    break
                for piece in reply.feed(ev):
                    await sse.data(shape.chunk(piece))
                ev = await _next(events, reply)
        except ApiError as err:
            # Mid-stream failure: a final error object, then the stream ends.
            await sse.data(err.body())
        await sse.close()
        return sse.response


async def chat_completions(request: web.Request) -> web.StreamResponse:
    req = await decode_body(request, ChatRequest)
    messages = req.chat_messages()
    params = req.chat_sampling()
    keep_alive = req.keep_alive_s()
    tools = req.function_tools()
    choice = req.checked_tool_choice([t.name for t in tools])
    pool = request.app[POOL]
    # The template decides the tool-call format and whether the model thinks.
    facts = await pool.facts(req.model)
    plan = tool_plan(messages, params, profile_for(facts.chat_template),
                     tools=tools, choice=choice, parallel=req.parallel_calls)
    stream = pool.generate(req.model, messages=plan.messages, tools=plan.tools, params=plan.params,
                           template_vars=plan.template_vars, request_id=request.get("request_id", ""),
                           keep_alive=keep_alive)
    shape = _Shape(True, req.model)
    reply = Reply.of(plan)
    if req.stream:
        return await _stream(request, shape, stream, reply, req.include_usage)
    pieces, done = await _collect(stream, reply)
    return json_response(shape.whole(pieces, done, reply.reasoning_tokens))


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
        return await _stream(request, shape, stream, Reply(), req.include_usage)
    pieces, done = await _collect(stream, Reply())
    if req.echo:
        pieces.insert(0, Text(prompt))
    return json_response(shape.whole(pieces, done))


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
