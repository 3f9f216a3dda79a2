"""``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``, ``/v1/models``.

Chat output is planned and parsed the way the Responses API does it: offered
tools may be forced with a grammar, and when the request offers tools or the
template thinks, calls become ``tool_calls`` and ``<think>`` text becomes
``reasoning_content``. Otherwise the model's text passes through unchanged.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import secrets
import struct
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from supervisor.api import user_view
from supervisor.api.adapter_views import v1_pairs
from supervisor.api.auth import request_scope
from supervisor.api.callers import caller_of
from supervisor.api.io import SseWriter, decode_body, json_response
from supervisor.api.models import model_media
from supervisor.api.openai_types import ChatRequest, CompletionRequest, EmbeddingRequest
from supervisor.api.streaming import open_stream
from supervisor.appkeys import CONFIG, POOL
from supervisor.errors import ApiError, BadRequest
from supervisor.generation.images import Images, require_media, require_vision
from supervisor.generation.output_format import enforce_format
from supervisor.generation.pieces import Piece, Reasoning, StreamParser, Text, ToolCall
from supervisor.generation.profile import served_profile
from supervisor.generation.template_vars import checked_kwargs, merged_vars
from supervisor.models.hf_vision import hf_takes_images
from supervisor.models.library import ModelEntry
from supervisor.models.projector import Modalities, projector_modalities
from supervisor.responses.items import new_id
from supervisor.responses.logprobs import (
    LogprobEntry,
    TextLogprobs,
    chat_logprobs,
    completion_logprobs,
)
from supervisor.responses.runner import Plan, tool_plan
from supervisor.workers.pool import Generation, WorkerPool
from supervisor.workers.replies import Blame, Rejected
from worker.protocol import Delta, Done, SamplingParams, TokenLogprob

_FINISH = {"stop": "stop", "length": "length", "cancelled": "stop"}


def _usage(dones: list[Done], reasoning_tokens: int = 0) -> dict[str, Any]:
    """Usage of all choices: the prompt counts once, as OpenAI counts it."""
    prompt = dones[0].prompt_tokens
    completion = sum(d.completion_tokens for d in dones)
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": dones[0].cached_tokens},
    }
    if reasoning_tokens:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return usage


def _choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """Sampling for each of ``n`` choices: a fixed seed advances by one per
    choice, so the choices differ and the whole reply stays reproducible."""
    if params.seed is None:
        return [params] * n
    return [msgspec.structs.replace(params, seed=params.seed + i) for i in range(n)]


def _finish_reason(done: Done, called: bool) -> str:
    reason = _FINISH[done.finish_reason]
    # A call cut by the token limit stays "length": its arguments may be incomplete.
    return "tool_calls" if called and reason == "stop" else reason


def tool_call(call: ToolCall, call_id: str) -> dict[str, Any]:
    """A parsed call in the chat-completions shape (one the output ended
    inside has the arguments written so far, as OpenAI sends it)."""
    return {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def chat_message(pieces: list[Piece], forced_call: bool = False) -> dict[str, Any]:
    """The assistant message of a whole reply; content is null beside calls
    and no text, and always under a forced call (as its streamed first chunk says)."""
    text = "".join(p.text for p in pieces if isinstance(p, Text))
    reasoning = "".join(p.text for p in pieces if isinstance(p, Reasoning))
    calls = [tool_call(p, new_id("call")) for p in pieces if isinstance(p, ToolCall)]
    message: dict[str, Any] = {"role": "assistant",
                               "content": text if text or not (calls or forced_call) else None}
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


# Pieces of a reply and the logprobs of their text (None when not asked for).
Pieces = tuple[list[Piece], list[LogprobEntry] | None]


class Reply:
    """Model text -> pieces: parsed when the plan calls for it, else passed through."""

    def __init__(self, parser: StreamParser | None = None, forced_call: bool = False,
                 logprobs: bool = False, prompt_field: str = "prompt") -> None:
        self._parser = parser
        self.forced_call = forced_call
        self.prompt_field = prompt_field  # where a chat's prompt is: messages
        self.reasoning_tokens = 0
        self._logprobs = TextLogprobs() if logprobs else None

    @classmethod
    def of(cls, plan: Plan) -> Reply:
        parses = bool(plan.tool_names) or plan.profile.thinks
        return cls(plan.parser() if parses else None, forced_call=plan.forced_call,
                   logprobs=plan.params.logprobs is not None, prompt_field="messages")

    def _with_logprobs(self, pieces: list[Piece], tokens: list[TokenLogprob] | None) -> Pieces:
        return pieces, self._logprobs.take(tokens, pieces) if self._logprobs is not None else None

    def feed(self, delta: Delta) -> Pieces:
        if self._parser is None:
            return self._with_logprobs([Text(delta.text)], delta.logprobs)
        if self._parser.in_reasoning:
            self.reasoning_tokens += delta.n_tokens
        return self._with_logprobs(self._parser.feed(delta.text), delta.logprobs)

    def finish(self) -> Pieces:
        return self._with_logprobs(self._parser.finish() if self._parser is not None else [], None)

    def in_chat_terms(self, exc: BadRequest) -> BadRequest:
        """The one place a worker's rejection gets its chat (or legacy
        completions) field: a forced call's grammar is tool_choice's."""
        if not isinstance(exc, Rejected):
            return exc
        if exc.cause is Blame.GRAMMAR:
            return exc.blaming("tool_choice" if self.forced_call else "response_format")
        return exc.blaming(self.prompt_field)


class _Shape:
    """What differs between chat and text completions in the reply objects."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.calls: dict[int, int] = {}  # tool calls streamed so far per choice, each chunk naming its index
        self.offsets: dict[int, int] = {}  # text streamed so far per legacy choice (logprobs' text_offset)

    def _wrap(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices}

    def whole(self, replies: list[Collected], reasoning_tokens: int = 0) -> dict[str, Any]:
        choices = []
        for index, reply in enumerate(replies):
            pieces, done = reply.pieces, reply.done
            if self.chat:
                message = chat_message(pieces, reply.forced_call)
                logprobs = chat_logprobs(reply.logprobs) if reply.logprobs is not None else None
                choices.append({"index": index, "message": message,
                                "finish_reason": _finish_reason(done, "tool_calls" in message), "logprobs": logprobs})
            else:
                text = "".join(p.text for p in pieces if isinstance(p, Text))
                echoed = len(reply.echo)
                choices.append({"index": index, "text": reply.echo + text,
                                "finish_reason": _FINISH[done.finish_reason],
                                "logprobs": completion_logprobs(reply.logprobs, echoed)
                                if reply.logprobs is not None else None})
        body = self._wrap("chat.completion" if self.chat else "text_completion", choices)
        body["usage"] = _usage([reply.done for reply in replies], reasoning_tokens)
        return body

    def chunk(self, index: int, piece: Piece | None, finish: str | None = None, first: bool = False,
              logprobs: list[LogprobEntry] | None = None) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if piece is not None:
                calls = self.calls.get(index, 0)
                delta.update(chat_delta(piece, calls))
                if isinstance(piece, ToolCall):
                    self.calls[index] = calls + 1
            choice = {"index": index, "delta": delta, "finish_reason": finish,
                      "logprobs": chat_logprobs(logprobs) if logprobs else None}
            return self._wrap("chat.completion.chunk", [choice])
        text = piece.text if isinstance(piece, Text) else ""
        offset = self.offsets.get(index, 0)
        self.offsets[index] = offset + len(text)
        return self._wrap("text_completion", [{
            "index": index, "text": text, "finish_reason": finish,
            "logprobs": completion_logprobs(logprobs, offset) if logprobs else None}])

    def final_chunk(self, index: int, done: Done) -> dict[str, Any]:
        return self.chunk(index, None, _finish_reason(done, self.calls.get(index, 0) > 0))

    def usage_chunk(self, dones: list[Done], reasoning_tokens: int = 0) -> dict[str, Any]:
        body = self._wrap("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = _usage(dones, reasoning_tokens)
        return body


@dataclass
class Collected:
    """One choice's whole reply."""

    pieces: list[Piece]
    done: Done
    logprobs: list[LogprobEntry] | None = None
    forced_call: bool = False
    echo: str = ""  # a legacy completion's prompt, echoed before its text


class _Choice:
    """One choice's admitted generation and the parsing of its text."""

    def __init__(self, outputs: Generation, reply: Reply) -> None:
        self.outputs = outputs
        self.reply = reply

    async def next(self) -> Delta | Done:
        try:
            return await anext(self.outputs)
        except StopAsyncIteration:
            raise RuntimeError("generation ended without a Done event") from None
        except BadRequest as exc:
            raise self.reply.in_chat_terms(exc) from exc

    async def collect(self) -> Collected:
        pieces: list[Piece] = []
        logprobs: list[LogprobEntry] | None = None
        while True:
            ev = await self.next()
            more, tokens = self.reply.finish() if isinstance(ev, Done) else self.reply.feed(ev)
            pieces += more
            if tokens is not None:
                logprobs = [*(logprobs or []), *tokens]
            if isinstance(ev, Done):
                return Collected(pieces, ev, logprobs, self.reply.forced_call)


async def _admit(stack: AsyncExitStack, pool: WorkerPool, model: str, reply: Callable[[], Reply],
                 params: list[SamplingParams], **kwargs: Any) -> list[_Choice]:
    """Queue every choice now, so a refusal (queue full, GPU busy) is an HTTP
    error for the whole request; leaving the stack withdraws what is left."""
    choices = []
    for sampling in params:
        outputs = await pool.admit(model, params=sampling, **kwargs)
        stack.push_async_callback(outputs.aclose)
        choices.append(_Choice(outputs, reply()))
    return choices


async def _stream(request: web.Request, shape: _Shape, choices: list[_Choice],
                  include_usage: bool) -> web.StreamResponse:
    sse, first = await open_stream(request, choices[0].next(), request.app[CONFIG].responses_keepalive_s)
    try:
        ev = first.result()  # a failure after a long prefill: the stream's error object
        dones = []
        for index, choice in enumerate(choices):
            if index:
                ev = await choice.next()
            if shape.chat:
                # A forced call has no text: its content stays null, as in a whole reply.
                await sse.data(shape.chunk(index, None if choice.reply.forced_call else Text(""), first=True))
            while not isinstance(ev, Done):
                await _send(sse, shape, index, choice.reply.feed(ev))
                ev = await choice.next()
            await _send(sse, shape, index, choice.reply.finish())
            await sse.data(shape.final_chunk(index, ev))
            dones.append(ev)
        if include_usage:
            await sse.data(shape.usage_chunk(dones, sum(c.reply.reasoning_tokens for c in choices)))
        await sse.raw(b"data: [DONE]\n\n")
    except ApiError as err:
        # Mid-stream failure (a crash, the shutdown): a final error object,
        # then the stream's usual end, so a client reading to [DONE] sees a
        # complete stream rather than a cut connection (vLLM does the same).
        if request_scope(request) is not None:  # a user key: no engine internals
            err = user_view.engine_error(err, request.get("request_id", ""))
        await sse.data(err.body())
        await sse.raw(b"data: [DONE]\n\n")
    await sse.close()
    return sse.response


async def _send(sse: SseWriter, shape: _Shape, index: int, pieces: Pieces) -> None:
    """A chunk per piece; the logprobs of their text go with the first text piece."""
    parts, logprobs = pieces
    for piece in parts:
        tokens = logprobs if isinstance(piece, Text) else None
        if tokens is not None:
            logprobs = None
        await sse.data(shape.chunk(index, piece, logprobs=tokens))


async def _reply(request: web.Request, shape: _Shape, choices: list[_Choice], stream: bool,
                 include_usage: bool, echo: str | None = None) -> web.StreamResponse:
    if stream:
        return await _stream(request, shape, choices, include_usage)
    replies = [await choice.collect() for choice in choices]
    if echo is not None:
        replies = [Collected(r.pieces, r.done, r.logprobs, r.forced_call, echo) for r in replies]
    return json_response(shape.whole(replies, sum(c.reply.reasoning_tokens for c in choices)))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    req = await decode_body(request, ChatRequest)
    images = Images()
    # Decoding images and building a forced call's grammar are CPU work on
    # request data: done in a thread, so the event loop keeps serving.
    messages = await asyncio.to_thread(req.chat_messages, images)
    params = req.chat_sampling()
    keep_alive = req.keep_alive_s()
    offer = req.tool_offer()
    checked_kwargs(req.chat_template_kwargs, req.enable_thinking)  # a 400 before any load
    pool = request.app[POOL]
    if images.data:
        # What the linked projector (if any) cannot take is refused before
        # the model loads for nothing.
        entry = pool.models.entry(req.model)
        linked = Modalities(False, False)
        if entry is not None and entry.kind == "hf":
            # Its vision tower is in its own weights; its worker confirms once loaded.
            linked = Modalities(hf_takes_images(entry.path), False)
        elif entry is not None and entry.mmproj is not None:
            # A projector the header does not tell about: its worker decides, with its reason.
            linked = projector_modalities(entry.mmproj) or Modalities(True, True)
        if entry is not None:
            # Without a link, the library's note says why none of its folder fits.
            why = entry.projector_note or "" if entry.mmproj is None else ""
            if entry.kind == "hf":
                why = "its config.json declares no vision tower"
            require_media(req.model, images, linked.vision, linked.audio, why)
    # The template decides the tool-call format and whether the model thinks.
    facts = await pool.facts(req.model)
    require_vision(req.model, images, facts)
    profile = served_profile(facts)
    schema = params.json_schema
    plan = await asyncio.to_thread(functools.partial(
        tool_plan, messages, params, profile, tools=offer.functions, choice=offer.choice,
        parallel=req.parallel_calls, guidance=facts.schema_grammar == "llguidance", model=req.model,
        template_vars=merged_vars(profile.template_vars(req.reasoning_effort), req.chat_template_kwargs,
                                  req.enable_thinking)))
    enforce_format(schema, plan.params, facts, generic_answer=plan.may_answer, strict=req.schema_strict,
                   param="response_format.json_schema.schema", model=req.model)
    async with AsyncExitStack() as stack:
        choices = await _admit(stack, pool, req.model, lambda: Reply.of(plan), _choice_params(plan.params, req.n),
                               messages=plan.messages, tools=plan.tools, template_vars=plan.template_vars,
                               request_id=request.get("request_id", ""), keep_alive=keep_alive,
                               images=images.data, lora_scale=req.lora_scale, caller=caller_of(request),
                               sampling_asked=req.sampling_asked())
        return await _reply(request, _Shape(True, req.model), choices, req.stream, req.include_usage)


async def completions(request: web.Request) -> web.StreamResponse:
    req = await decode_body(request, CompletionRequest)
    prompt = req.prompt_text()
    params = req.sampling()
    if params.max_tokens is None:
        params.max_tokens = 16  # OpenAI's default for legacy completions
    params.logprobs = req.logprobs

    def reply() -> Reply:
        return Reply(logprobs=req.logprobs is not None)

    async with AsyncExitStack() as stack:
        choices = await _admit(stack, request.app[POOL], req.model, reply, _choice_params(params, req.n),
                               prompt=prompt, request_id=request.get("request_id", ""),
                               keep_alive=req.keep_alive_s(), lora_scale=req.lora_scale,
                               caller=caller_of(request), sampling_asked=req.sampling_asked())
        return await _reply(request, _Shape(False, req.model), choices, req.stream, req.include_usage,
                            echo=prompt if req.echo else None)


async def embeddings(request: web.Request) -> web.Response:
    req = await decode_body(request, EmbeddingRequest)
    try:
        result = await request.app[POOL].embed(req.model, req.inputs(), caller_of(request))
    except Rejected as exc:
        raise exc.blaming("input") from exc
    data = []
    for i, vec in enumerate(result.vectors):
        emb: list[float] | str = vec
        if req.encoding_format == "base64":
            emb = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    return json_response({"object": "list", "data": data, "model": req.model,
                          "usage": {"prompt_tokens": result.prompt_tokens,
                                    "total_tokens": result.prompt_tokens}})


def _media_flags(pool: WorkerPool, entry: ModelEntry) -> dict[str, bool]:
    media, _ = model_media(pool, entry)
    return {"vision": media.vision, "audio": media.audio}


async def list_models(request: web.Request) -> web.Response:
    pool = request.app[POOL]
    data = []
    for entry in pool.models.entries():
        status = pool.status(entry.id)
        state = status["state"] if status else ("unloaded" if entry.usable else "unusable")
        reason = status["reason"] if status else entry.reason
        data.append({"id": entry.id, "object": "model", "created": int(entry.mtime),
                     "owned_by": "gpuvisor", "state": state, "reason": reason,
                     "engine": entry.engine, **_media_flags(pool, entry)})
    data += v1_pairs(pool)  # <base>:<adapter> pairs (supervisor/api/adapter_views.py)
    return json_response({"object": "list", "data": data})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/embeddings", embeddings)
