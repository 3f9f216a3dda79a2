"""The Responses API's operations, independent of HTTP.

:class:`ResponsesService` ties the pool, the store and the background tasks
together. A stored response is written before its terminal event leaves, so a
client that has seen ``response.completed`` can continue the conversation at
once; with ``store: false`` nothing is written at all. A background
response's events go to its event log (``eventlog``), which clients stream,
leave and resume from a sequence number.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Literal

import msgspec

from supervisor.generation.tools import PlanChoice, runs_here
from supervisor.errors import (
    ApiError,
    BadRequest,
    Conflict,
    ModelNotFound,
    NotFound,
    StorageFull,
    Unavailable,
)
from supervisor.responses import truncation
from supervisor.responses.background import BackgroundTasks
from supervisor.responses.convert import to_messages
from supervisor.responses.eventlog import TERMINAL_EVENTS, LiveEvents, LiveLogs
from supervisor.responses.events import Event, EventBuilder
from supervisor.responses.items import Item
from supervisor.responses.models import CreateRequest, ValidRequest
from supervisor.responses.objects import ResponseObject, new_response, snapshot
from supervisor.responses.runner import (
    GenerationPool,
    Outputs,
    Plan,
    admit,
    in_responses_terms,
    plan,
    run,
)
from supervisor.responses.hosted.code_interpreter import Containers
from supervisor.responses.hosted.approvals import approved_calls
from supervisor.responses.hosted.file_search import KnowledgeRef
from supervisor.responses.hosted.loop import ToolLoop
from supervisor.responses.hosted.session import HostedSession, open_session, refuse_early
from supervisor.responses.hosted.settings import HostedSettings
from supervisor.responses.store import ResponseStore
from supervisor.workers.crash_keys import CrashCooldown

DEFAULT_KEEPALIVE_S = 10.0


@dataclass
class ResponseStream:
    """A streamed response's events; ``aclose()`` also cancels the
    generation when the events were never read (the client left early)."""

    events: AsyncGenerator[Event, None]
    outputs: Outputs | None = None

    async def aclose(self) -> None:
        await self.events.aclose()
        if self.outputs is not None:
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
        hosted: HostedSettings | None = None,
        containers: Containers | None = None,
        knowledge: KnowledgeRef | None = None,
    ) -> None:
        self.pool = pool
        self.hosted = hosted or HostedSettings()
        # The code_interpreter's sandbox containers, or why there are none.
        self.containers = containers or Containers()
        # The knowledge base file_search searches, once the app has made it.
        self.knowledge = knowledge
        self.store = store
        self.background = background
        self.keepalive_s = keepalive_s
        self._clock = clock
        self.live = LiveLogs(store)

    # --------------------------------------------------------------- create

    async def _history(self, req: CreateRequest, owner: str | None) -> list[Item]:
        if req.previous_response_id is None:
            return []
        # Another key's response is no previous response of this one (404).
        previous, items = await self.store.history(req.previous_response_id, owner)
        if not previous.terminal:
            raise Conflict(
                f"previous response {previous.id!r} is still {previous.status}",
                param="previous_response_id",
                code="previous_response_in_progress",
            )
        return items

    async def _generation(self, valid: ValidRequest, history: list[Item], request_id: str,
                          wait_s: float | None) -> tuple[Plan, Outputs]:
        """Plan and queue the generation, then wait (up to ``wait_s``, None:
        as long as it takes) for the worker to take it, so a prompt it rejects
        (too long, a bad grammar) raises here. With ``truncation: "auto"`` a
        prompt it finds too long loses older items and is queued again."""
        req = valid.body
        facts = await self.pool.facts(req.model)
        auto = req.truncation == "auto"
        dropped = await truncation.first_drop(
            self.pool, req.model, history=history, items=valid.items, instructions=req.instructions,
            tools=valid.offer.functions, n_ctx=facts.n_ctx, max_output_tokens=req.max_output_tokens,
        ) if auto else 0
        retries = 0
        while True:
            kept_history, kept_items = truncation.without_oldest(history, valid.items, dropped)
            # CPU work on request data (a forced call's grammar, images): off the loop.
            generation = await asyncio.to_thread(plan, req, kept_history, kept_items, facts, valid.offer)
            outputs = await admit(self.pool, req.model, generation, request_id, valid.caller)
            try:
                await self._accepted(outputs, wait_s)
            except BadRequest as exc:
                await outputs.aclose()
                more = truncation.next_drop(dropped, retries, len(history) + len(valid.items))
                if not auto or exc.code != "context_length_exceeded" or more is None:
                    raise in_responses_terms(exc, generation) from exc
                dropped, retries = more, retries + 1
                continue
            except BaseException:
                await outputs.aclose()
                raise
            return generation, outputs

    @staticmethod
    async def _accepted(outputs: Outputs, wait_s: float | None) -> None:
        """Bounded for a stream by the keepalive interval, the silence a client
        sees anyway before the first keepalive: a request still queued then
        streams, and a later rejection ends the stream in ``response.failed``."""
        try:
            await asyncio.wait_for(outputs.accepted(), wait_s)
        except TimeoutError:
            return

    async def _save(self, resp: ResponseObject, valid: ValidRequest, owner: str | None) -> None:
        if valid.body.store:
            await self.store.save(resp, valid.items, owner)

    async def stream(self, valid: ValidRequest, owner: str | None = None) -> ResponseStream:
        """Check what can fail with an HTTP error (a bad request, an unknown
        model, a full queue or a busy GPU), then return the event stream.
        ``owner``: the API key id creating it (None: the admin, or auth off)."""
        history = await self._history(valid.body, owner)
        resp = new_response(valid.body, self._clock(), "in_progress")
        valid, session = await self._hosted(valid, history, owner)
        first = await self._first(valid, history, resp.id, self.keepalive_s, session)
        return ResponseStream(self._events(resp, valid, first, owner, history, session),
                              first[1] if first is not None else None)

    # ------------------------------------------------------- hosted tools

    async def _hosted(self, valid: ValidRequest, history: list[Item],
                      owner: str | None) -> tuple[ValidRequest, HostedSession | None]:
        """The request with its hosted tools set up and offered (responses/hosted/), if it has any."""
        if not any(runs_here(t) for t in valid.body.tools):
            approved_calls(history, valid.items, set())  # an approved call whose server is not in tools: a 400
            return valid, None
        return await open_session(valid, history, self.hosted, self.containers, owner, self.knowledge)

    async def _first(self, valid: ValidRequest, history: list[Item], request_id: str, wait_s: float | None,
                     session: HostedSession | None) -> tuple[Plan, Outputs] | None:
        """The first generation, queued; None when calls the user approved
        run first (the loop plans it with their results)."""
        if session is not None and session.approved:
            return None
        return await self._generation(valid, history, request_id, wait_s)

    def _generated(self, resp: ResponseObject, valid: ValidRequest, history: list[Item],
                   first: tuple[Plan, Outputs] | None, session: HostedSession | None, builder: EventBuilder,
                   halt: Callable[[], ApiError | None] | None = None) -> AsyncGenerator[Event, None]:
        """The events of the response: one generation, or a hosted tool loop of several."""
        if session is None:
            assert first is not None
            generation, outputs = first
            return run(self.pool, resp.model, generation, builder, request_id=resp.id, admitted=outputs, halt=halt)

        async def next_generation(output: list[Item], choice: PlanChoice) -> tuple[Plan, Outputs]:
            later = msgspec.structs.replace(valid, items=[*valid.items, *output],
                                            offer=dataclasses.replace(valid.offer, choice=choice))
            return await self._generation(later, history, resp.id, None)

        return ToolLoop(session).events(self.pool, resp.model, builder, first, next_generation,
                                        choice=valid.offer.choice, request_id=resp.id, halt=halt)

    async def _events(
        self, resp: ResponseObject, valid: ValidRequest, first: tuple[Plan, Outputs] | None, owner: str | None,
        history: list[Item], session: HostedSession | None,
    ) -> AsyncGenerator[Event, None]:
        builder = EventBuilder(resp, self._clock)
        async for event in self._generated(resp, valid, history, first, session, builder):
            if event.type in TERMINAL_EVENTS:
                await self._save(resp, valid, owner)
            yield event

    async def create(self, valid: ValidRequest, owner: str | None = None) -> ResponseObject:
        """Run to the end and return the final object (non-streaming)."""
        history = await self._history(valid.body, owner)
        resp = new_response(valid.body, self._clock(), "in_progress")
        builder = EventBuilder(resp, self._clock)
        valid, session = await self._hosted(valid, history, owner)
        try:
            first = await self._first(valid, history, resp.id, None, session)
        except (ModelNotFound, Unavailable, BadRequest, CrashCooldown):
            raise  # the request itself cannot be served: an HTTP error
        except ApiError as exc:
            # The worker failed under it (e.g. crashed): a failed response, as mid-generation.
            builder.start()
            builder.failed(exc.code or "server_error", exc.message)
            await self._save(resp, valid, owner)
            return resp
        if session is not None:
            async for _ in self._generated(resp, valid, history, first, session, builder):
                pass
        else:
            assert first is not None
            generation, outputs = first
            async for _ in run(self.pool, resp.model, generation, builder, request_id=resp.id, raise_early=True,
                               admitted=outputs):
                pass
        await self._save(resp, valid, owner)
        return resp

    async def create_background(self, valid: ValidRequest, owner: str | None = None) -> ResponseObject:
        """Store the response as queued and run it detached from the request;
        its events are logged for clients that stream or attach later."""
        history = await self._history(valid.body, owner)
        # Reject a bad conversation (e.g. an output for an unknown call) now, as a 400.
        to_messages(history, valid.items, valid.body.instructions)
        await refuse_early(valid, history, self.hosted, self.containers, owner, self.knowledge)
        self.background.check_capacity()
        resp = new_response(valid.body, self._clock(), "queued")
        builder = EventBuilder(resp, self._clock)
        await self.store.save(resp, valid.items, owner)
        log = self.live.open(resp.id)
        try:
            await log.add(builder.queued())
            queued = snapshot(resp)
            self.background.submit(resp.id, self._run_background(resp, valid, history, builder, log, owner))
        except BaseException:
            await self.live.finish(resp.id)
            raise
        return queued

    async def _run_background(self, resp: ResponseObject, valid: ValidRequest, history: list[Item],
                              builder: EventBuilder, log: LiveEvents, owner: str | None) -> None:
        try:
            try:
                # Stays queued until a slot frees (a cancel meanwhile is recorded below).
                async with self.background.slot():
                    await self._mark_running(resp)
                    await self._generate_into(log, resp, valid, history, builder, owner)
            except asyncio.CancelledError:
                if self.background.cancel_requested(resp.id):
                    builder.cancelled()
                else:
                    await log.add(builder.failed("interrupted", "the server shut down while this response ran"))
                log.close()
                # No waiting for the disk here: a cancel then answers 507, and
                # boot recovery marks a response shut down unsaved interrupted.
                with contextlib.suppress(StorageFull):
                    await log.store_end(resp)
                raise
            # Followers have the terminal event: their streams end now, while
            # a full disk may hold up storing it (a replay reads it from here).
            log.close()
            try:
                await log.store_end_eventually(resp)
            except asyncio.CancelledError:
                # Shut down (or deleted) with the end unsaved: a last try, else boot recovery marks it interrupted.
                with contextlib.suppress(StorageFull):
                    await log.store_end(resp)
                raise
        finally:
            await self.live.finish(resp.id)

    async def _mark_running(self, resp: ResponseObject) -> None:
        resp.status = "in_progress"
        try:
            await self.store.update(resp)
        except StorageFull:
            # The generation needs no disk: the row says queued until its end is stored.
            return

    async def _generate_into(self, log: LiveEvents, resp: ResponseObject, valid: ValidRequest,
                             history: list[Item], builder: EventBuilder, owner: str | None) -> None:
        try:
            valid, session = await self._hosted(valid, history, owner)
            first = await self._first(valid, history, resp.id, None, session)
        except ApiError as exc:
            await log.add(builder.start())
            await log.add(builder.failed(exc.code or "server_error", exc.message))
            return
        async for event in self._generated(resp, valid, history, first, session, builder, halt=log.refusal):
            await log.add([event])

    async def follow(self, response_id: str, after: int, scope: str | None = None) -> ResponseStream:
        """The events of a background response after sequence number ``after``:
        live while it runs, stored once it has finished (or the service restarted)."""
        resp = await self.get(response_id, scope)
        if not resp.background:
            raise BadRequest("only background responses can be streamed again; this one was not background",
                             param="stream")
        return ResponseStream(self.live.follow(response_id, after))

    # ----------------------------------------------------------- retrieval

    # ``scope``: the API key id of the caller, who sees only what it created
    # (another key's response is 404, as if it did not exist); None sees all.

    async def get(self, response_id: str, scope: str | None = None) -> ResponseObject:
        resp = await self.store.get(response_id, scope)
        if resp is None:
            raise NotFound(f"response {response_id!r} not found", param="response_id")
        return resp

    async def delete(self, response_id: str, scope: str | None = None) -> None:
        # The row first: a full disk refusing it (507) leaves a running
        # response running, not cancelled with its end unsaved. A task still
        # running stores nothing for a row that is gone.
        if not await self.store.delete(response_id, scope):
            raise NotFound(f"response {response_id!r} not found", param="response_id")
        await self.background.cancel(response_id)
        await self.live.finish(response_id)

    async def cancel(self, response_id: str, scope: str | None = None) -> ResponseObject:
        resp = await self.get(response_id, scope)
        if not resp.background:
            raise BadRequest("only background responses can be cancelled", param="response_id")
        if resp.status == "cancelled":
            return resp
        if resp.terminal:
            raise Conflict(f"response {response_id!r} already finished ({resp.status})", code="response_finished")
        live = self.live.get(response_id)
        if live is not None and live.final is not None:
            raise Conflict(f"response {response_id!r} already finished ({live.final.status}); the full disk "
                           "holds up storing it", code="response_finished")
        await self.background.cancel(response_id)
        resp = await self.get(response_id)
        if not resp.terminal:
            # Cancelled before its task first ran: nothing else will record it.
            resp.status = "cancelled"
            await self.store.update(resp)
        await self.live.finish(response_id)
        return resp

    async def input_items(
        self, response_id: str, *, after: str | None, limit: int, order: Literal["asc", "desc"],
        scope: str | None = None,
    ) -> tuple[list[Item], bool]:
        return await self.store.input_items(response_id, after=after, limit=limit, order=order, scope=scope)
