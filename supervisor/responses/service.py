"""The Responses API's operations, independent of HTTP.

:class:`ResponsesService` ties the pool, the store and the background tasks
together. A stored response is written before its terminal event leaves, so a
client that has seen ``response.completed`` can continue the conversation at
once; with ``store: false`` nothing is written at all.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Literal

from supervisor.errors import ApiError, BadRequest, Conflict, NotFound
from supervisor.responses.background import BackgroundTasks
from supervisor.responses.convert import to_messages
from supervisor.responses.events import Event, EventBuilder
from supervisor.responses.items import Item
from supervisor.responses.models import CreateRequest, ValidRequest
from supervisor.responses.objects import ResponseObject, new_response, snapshot
from supervisor.responses.runner import GenerationPool, Outputs, Plan, admit, in_responses_terms, plan, run
from supervisor.responses.store import ResponseStore

DEFAULT_KEEPALIVE_S = 10.0
TERMINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})


@dataclass
class ResponseStream:
    """A streamed response's events; ``aclose()`` also cancels the
    generation when the events were never read (the client left early)."""

    events: AsyncGenerator[Event, None]
    outputs: Outputs

    async def aclose(self) -> None:
        await self.events.aclose()
        await self.outputs.aclose()


class ResponsesService:
    def __init__(
        self,
        pool: GenerationPool,
        store: ResponseStore,
        background: BackgroundTasks,
        *,
        keepalive_s: float = DEFAULT_KEEPALIVE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.pool = pool
        self.store = store
        self.background = background
        self.keepalive_s = keepalive_s
        self._clock = clock

    # --------------------------------------------------------------- create

    async def _history(self, req: CreateRequest) -> list[Item]:
        if req.previous_response_id is None:
            return []
        previous, items = await self.store.history(req.previous_response_id)
        if not previous.terminal:
            raise Conflict(
                f"previous response {previous.id!r} is still {previous.status}",
                param="previous_response_id",
                code="previous_response_in_progress",
            )
        return items

    async def _plan(self, valid: ValidRequest, history: list[Item]) -> Plan:
        facts = await self.pool.facts(valid.body.model)
        return plan(valid.body, history, valid.items, facts)

    async def _save(self, resp: ResponseObject, valid: ValidRequest) -> None:
        if valid.body.store:
            await self.store.save(resp, valid.items)

    async def stream(self, valid: ValidRequest) -> ResponseStream:
        """Check what can fail with an HTTP error (a bad request, an unknown
        model, a full queue or a busy GPU), then return the event stream."""
        history = await self._history(valid.body)
        generation = await self._plan(valid, history)
        resp = new_response(valid.body, self._clock(), "in_progress")
        outputs = await admit(self.pool, resp.model, generation, resp.id)
        try:
            await self._accepted(outputs, generation)
        except BaseException:
            await outputs.aclose()
            raise
        return ResponseStream(self._events(resp, valid, generation, outputs), outputs)

    async def _accepted(self, outputs: Outputs, generation: Plan) -> None:
        """Wait for the worker to take the request, so a prompt it rejects
        (too long, a bad grammar) is an HTTP 400 like chat's. Bounded by the
        keepalive interval, the silence a client sees anyway before the first
        keepalive: a request still queued then streams, and a later rejection
        ends the stream in ``response.failed``."""
        try:
            await asyncio.wait_for(outputs.accepted(), self.keepalive_s)
        except TimeoutError:
            return
        except BadRequest as exc:
            raise in_responses_terms(exc, generation) from exc

    async def _events(
        self, resp: ResponseObject, valid: ValidRequest, generation: Plan, outputs: Outputs
    ) -> AsyncGenerator[Event, None]:
        builder = EventBuilder(resp, self._clock)
        async for event in run(self.pool, resp.model, generation, builder, request_id=resp.id,
                               admitted=outputs):
            if event.type in TERMINAL_EVENTS:
                await self._save(resp, valid)
            yield event

    async def create(self, valid: ValidRequest) -> ResponseObject:
        """Run to the end and return the final object (non-streaming)."""
        history = await self._history(valid.body)
        generation = await self._plan(valid, history)
        resp = new_response(valid.body, self._clock(), "in_progress")
        builder = EventBuilder(resp, self._clock)
        async for _ in run(self.pool, resp.model, generation, builder, request_id=resp.id, raise_early=True):
            pass
        await self._save(resp, valid)
        return resp

    async def create_background(self, valid: ValidRequest) -> ResponseObject:
        """Store the response as queued and run it detached from the request."""
        history = await self._history(valid.body)
        # Reject a bad conversation (e.g. an output for an unknown call) now, as a 400.
        to_messages(history, valid.items, valid.body.instructions)
        self.background.check_capacity()
        resp = new_response(valid.body, self._clock(), "queued")
        await self.store.save(resp, valid.items)
        queued = snapshot(resp)
        self.background.submit(resp.id, self._run_background(resp, valid, history))
        return queued

    async def _run_background(self, resp: ResponseObject, valid: ValidRequest, history: list[Item]) -> None:
        builder = EventBuilder(resp, self._clock)
        try:
            # Stays queued until a slot frees (a cancel meanwhile is recorded below).
            async with self.background.slot():
                resp.status = "in_progress"
                await self.store.update(resp)
                try:
                    generation = await self._plan(valid, history)
                except ApiError as exc:
                    builder.failed(exc.code or "server_error", exc.message)
                else:
                    async for _ in run(self.pool, resp.model, generation, builder, request_id=resp.id):
                        pass
        except asyncio.CancelledError:
            if self.background.cancel_requested(resp.id):
                builder.cancelled()
            else:
                builder.failed("interrupted", "the server shut down while this response ran")
            await self.store.update(resp)
            raise
        await self.store.update(resp)

    # ----------------------------------------------------------- retrieval

    async def get(self, response_id: str) -> ResponseObject:
        resp = await self.store.get(response_id)
        if resp is None:
            raise NotFound(f"response {response_id!r} not found", param="response_id")
        return resp

    async def delete(self, response_id: str) -> None:
        await self.background.cancel(response_id)
        if not await self.store.delete(response_id):
            raise NotFound(f"response {response_id!r} not found", param="response_id")

    async def cancel(self, response_id: str) -> ResponseObject:
        resp = await self.get(response_id)
        if not resp.background:
            raise BadRequest("only background responses can be cancelled", param="response_id")
        if resp.status == "cancelled":
            return resp
        if resp.terminal:
            raise Conflict(f"response {response_id!r} already finished ({resp.status})", code="response_finished")
        await self.background.cancel(response_id)
        resp = await self.get(response_id)
        if not resp.terminal:
            # Cancelled before its task first ran: nothing else will record it.
            resp.status = "cancelled"
            await self.store.update(resp)
        return resp

    async def input_items(
        self, response_id: str, *, after: str | None, limit: int, order: Literal["asc", "desc"]
    ) -> tuple[list[Item], bool]:
        return await self.store.input_items(response_id, after=after, limit=limit, order=order)
