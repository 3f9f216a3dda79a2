"""The Responses API's app state: created at setup, started with the app.

The pool and the database are opened by other cleanup contexts, so the
service is built in :meth:`ResponsesApi.start`, which the app's cleanup
context calls once both exist; :meth:`ResponsesApi.stop` cancels and awaits
every background response before the database closes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from supervisor import appkeys
from supervisor.db import Database
from supervisor.errors import Unavailable
from supervisor.responses.background import (
    DEFAULT_PRUNE_INTERVAL_S,
    DEFAULT_RETENTION_S,
    BackgroundTasks,
)
from supervisor.responses.hosted.code_interpreter import Containers, expire_idle
from supervisor.responses.hosted.file_search import KnowledgeRef
from supervisor.responses.hosted.settings import HostedSettings
from supervisor.responses.runner import GenerationPool
from supervisor.responses.service import DEFAULT_KEEPALIVE_S, ResponsesService
from supervisor.responses.store import ResponseStore
from supervisor.sandbox.containers import ContainerPool

# Makes the code_interpreter's container pool, or says why there is none.
OpenContainers = Callable[[], Awaitable[tuple[ContainerPool | None, str | None]]]


class ResponsesApi:
    def __init__(
        self,
        *,
        retention_s: float = DEFAULT_RETENTION_S,
        prune_interval_s: float = DEFAULT_PRUNE_INTERVAL_S,
        keepalive_s: float = DEFAULT_KEEPALIVE_S,
        clock: Callable[[], float] = time.time,
        hosted: HostedSettings | None = None,
        open_containers: OpenContainers | None = None,
        knowledge: KnowledgeRef | None = None,
    ) -> None:
        self.hosted = hosted
        self._open_containers = open_containers
        self._knowledge = knowledge
        self.containers = Containers()
        self._expiry: asyncio.Task[None] | None = None
        self.retention_s = retention_s
        self.prune_interval_s = prune_interval_s
        self.keepalive_s = keepalive_s
        self._clock = clock
        self._service: ResponsesService | None = None

    @property
    def service(self) -> ResponsesService:
        if self._service is None:
            raise Unavailable("the Responses API is not started", code="starting")
        return self._service

    async def start(self, pool: GenerationPool, db: Database) -> None:
        store = ResponseStore(db)
        await store.ensure_schema()
        background = BackgroundTasks(
            store, retention_s=self.retention_s, prune_interval_s=self.prune_interval_s, clock=self._clock
        )
        await background.start()
        if self._open_containers is not None:
            containers, why_not = await self._open_containers()
            self.containers = Containers(containers, why_not or "")
            if containers is not None:
                self._expiry = asyncio.create_task(expire_idle(containers), name="containers-expiry")
        self._service = ResponsesService(pool, store, background, keepalive_s=self.keepalive_s, clock=self._clock,
                                         hosted=self.hosted, containers=self.containers,
                                         knowledge=self._knowledge)

    async def stop(self) -> None:
        if self._service is not None:
            service, self._service = self._service, None
            await service.background.stop()
        if self._expiry is not None:
            self._expiry.cancel()
            await asyncio.gather(self._expiry, return_exceptions=True)
            self._expiry = None
        if self.containers.pool is not None:
            # After the responses that ran code in them: their folders go too.
            self.containers.pool.close()

    async def context(self, app: web.Application) -> AsyncIterator[None]:
        """For ``app.cleanup_ctx``; registered after the pool's and the database's."""
        await self.start(app[appkeys.POOL], app[appkeys.DB])
        try:
            yield
        finally:
            await self.stop()


