"""HTTP routes of the Responses API (``/v1/responses``), and :func:`setup`,
which wires the service (supervisor/responses/) into the app with them."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Literal

from aiohttp import web

from supervisor.api.auth import request_scope
from supervisor.api.callers import caller_of
from supervisor.api.io import SseWriter, decode_body, json_response
from supervisor.api.streaming import Keepalive
from supervisor.appkeys import KNOWLEDGE, POOL, RESPONSES
from supervisor.errors import BadRequest
from supervisor.generation.images import no_vision_message
from supervisor.models.hf_vision import hf_takes_images
from supervisor.responses.background import DEFAULT_PRUNE_INTERVAL_S, DEFAULT_RETENTION_S
from supervisor.responses.convert import first_image
from supervisor.responses.events import Event
from supervisor.responses.hosted.settings import HostedSettings
from supervisor.responses.items import Item
from supervisor.responses.lifecycle import OpenContainers, ResponsesApi
from supervisor.responses.models import CreateRequest, validate
from supervisor.responses.service import DEFAULT_KEEPALIVE_S, ResponsesService, ResponseStream

log = logging.getLogger(__name__)

MAX_LIST_LIMIT = 100


def _service(request: web.Request) -> ResponsesService:
    return request.app[RESPONSES].service


async def create_response(request: web.Request) -> web.StreamResponse:
    body = await decode_body(request, CreateRequest)
    # In a thread: validation decodes the input images (up to 12 MiB of base64).
    valid = await asyncio.to_thread(validate, body)
    valid.caller = caller_of(request)  # background runs too blame crashes on who asked
    _refuse_images_early(request, body.model, valid.items)
    service = _service(request)
    owner = request_scope(request)  # the creating key: only it (and the admin) may use the response
    if body.background:
        queued = await service.create_background(valid, owner)
        if body.stream:
            # Following, not owning: a client that leaves does not cancel it.
            return await _stream(request, service, await service.follow(queued.id, after=-1, scope=owner))
        return json_response(queued)
    if body.stream:
        # A refusal (queue full, GPU busy) raises here: an HTTP error with
        # Retry-After, before the 200 of an event stream is committed.
        return await _stream(request, service, await service.stream(valid, owner))
    return json_response(await service.create(valid, owner))


def _refuse_images_early(request: web.Request, model: str, items: list[Item]) -> None:
    """Images to an hf model whose config.json declares no vision tower are
    a 400 before its worker starts, as in the chat route: a vLLM start takes
    most of a minute, for a refusal. Other models (and images in a previous
    response) are refused once the model's worker says (runner.plan)."""
    entry = request.app[POOL].models.entry(model)
    if entry is None or entry.kind != "hf" or hf_takes_images(entry.path):
        return
    param = first_image([], items)
    if param is not None:
        raise BadRequest(no_vision_message(model, "its config.json declares no vision tower"),
                         param=param, code="vision_unavailable")


async def _stream(request: web.Request, service: ResponsesService, stream: ResponseStream) -> web.StreamResponse:
    try:
        sse = await SseWriter.start(request)
        keepalive = Keepalive(sse, service.keepalive_s)
        pump = asyncio.create_task(_pump(stream.events, sse, keepalive), name="responses-stream")
        ticker = asyncio.create_task(keepalive.run(), name="responses-keepalive")
        tasks = [pump, ticker]
        try:
            # The ticker ends only by failing: then a client that left during a
            # long prefill is noticed without waiting for the first token.
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
    finally:
        await stream.aclose()
    for task in tasks:
        exc = None if task.cancelled() else task.exception()
        if isinstance(exc, ConnectionResetError):
            # Closing the event stream has cancelled the generation.
            log.info("client disconnected from streaming response")
            return sse.response
        if exc is not None:
            raise exc
    await sse.close()
    return sse.response


async def _pump(events: AsyncGenerator[Event, None], sse: SseWriter, keepalive: Keepalive) -> None:
    async with aclosing(events) as stream:
        async for event in stream:
            await sse.data(event.data, event=event.type)
            keepalive.wrote()


def _flag(raw: str, param: str) -> bool:
    value = raw.lower()
    if value in ("true", "1"):
        return True
    if value in ("false", "0", ""):
        return False
    raise BadRequest(f"{param} must be true or false, got {raw!r}", param=param)


# Event sequence numbers are SQLite integers: a cursor past them is refused
# here, before the stream's head, rather than overflowing inside its body.
MAX_SEQUENCE = 2**63 - 1


def _starting_after(raw: str | None) -> int:
    """The cursor, strictly: ``-1`` or ASCII digits (int() would also take
    ``+5``, `` 7`` and other scripts' digits), at most ``MAX_SEQUENCE``."""
    if raw is None:
        return -1
    digits = raw[1:] if raw.startswith("-") else raw
    if not (digits.isascii() and digits.isdigit()) or len(digits) > len(str(MAX_SEQUENCE)):
        raise BadRequest(f"starting_after must be an integer, got {raw!r}", param="starting_after")
    value = int(raw)
    if value < -1:
        raise BadRequest("starting_after must be -1 or more", param="starting_after")
    if value > MAX_SEQUENCE:
        raise BadRequest(f"starting_after must be at most {MAX_SEQUENCE}", param="starting_after")
    return value


async def get_response(request: web.Request) -> web.StreamResponse:
    service = _service(request)
    response_id = request.match_info["response_id"]
    query = request.query
    if _flag(query.get("stream", "false"), "stream"):
        # A background response's events, from the one after starting_after.
        return await _stream(request, service, await service.follow(response_id, _starting_after(
            query.get("starting_after")), request_scope(request)))
    if "starting_after" in query:
        raise BadRequest("starting_after applies only with stream=true", param="starting_after")
    return json_response(await service.get(response_id, request_scope(request)))


async def delete_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    await _service(request).delete(response_id, request_scope(request))
    return json_response({"id": response_id, "object": "response", "deleted": True})


async def cancel_response(request: web.Request) -> web.Response:
    return json_response(await _service(request).cancel(request.match_info["response_id"], request_scope(request)))


def _limit(raw: str | None) -> int:
    if raw is None:
        return 20
    try:
        value = int(raw)
    except ValueError as exc:
        raise BadRequest(f"limit must be an integer, got {raw!r}", param="limit") from exc
    if not 1 <= value <= MAX_LIST_LIMIT:
        raise BadRequest(f"limit must be within 1..{MAX_LIST_LIMIT}", param="limit")
    return value


def _order(raw: str | None) -> Literal["asc", "desc"]:
    if raw is None or raw == "desc":
        return "desc"
    if raw == "asc":
        return "asc"
    raise BadRequest(f"order must be 'asc' or 'desc', got {raw!r}", param="order")


async def list_input_items(request: web.Request) -> web.Response:
    query = request.query
    items, has_more = await _service(request).input_items(
        request.match_info["response_id"],
        after=query.get("after"),
        limit=_limit(query.get("limit")),
        order=_order(query.get("order")),
        scope=request_scope(request),
    )
    return json_response(
        {
            "object": "list",
            "data": items,
            "first_id": items[0].id if items else None,
            "last_id": items[-1].id if items else None,
            "has_more": has_more,
        }
    )


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
    app.router.add_get("/v1/responses/{response_id}/input_items", list_input_items)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel_response)


def setup(
    app: web.Application,
    *,
    retention_s: float = DEFAULT_RETENTION_S,
    prune_interval_s: float = DEFAULT_PRUNE_INTERVAL_S,
    keepalive_s: float = DEFAULT_KEEPALIVE_S,
    hosted: HostedSettings | None = None,
    open_containers: OpenContainers | None = None,
) -> ResponsesApi:
    """Add the routes, the ``RESPONSES`` state and its cleanup context, which
    starts after the database and the pool (add it after their contexts) and
    stops, cancelling background responses, before them. ``open_containers``
    makes the code_interpreter's sandbox containers at start (none: it is off)."""
    # The knowledge base starts after this context (its own, in the app): file_search looks it up per request.
    api = ResponsesApi(retention_s=retention_s, prune_interval_s=prune_interval_s, keepalive_s=keepalive_s,
                       hosted=hosted, open_containers=open_containers, knowledge=lambda: app.get(KNOWLEDGE))
    app[RESPONSES] = api
    add_routes(app)
    app.cleanup_ctx.append(api.context)
    return api
