"""The Responses API's app state: created at setup, started with the app.

The pool and the database are opened by other cleanup contexts, so the
service is built in :meth:`ResponsesApi.start`, which the app's cleanup
context calls once both exist; :meth:`ResponsesApi.stop` cancels and awaits
every background response before the database closes.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from supervisor import appkeys
from supervisor.db import Database
from supervisor.errors import Unavailable
from supervisor.responses.background import (
    DEFAULT_PRUNE_INTERVAL_S,
    DEFAULT_RETENTION_S,
    BackgroundTasks,
)
from supervisor.responses.hosted.settings import HostedSettings
from supervisor.responses.runner import GenerationPool
from supervisor.responses.service import DEFAULT_KEEPALIVE_S, ResponsesService
from supervisor.responses.store import ResponseStore


class ResponsesApi:
    def __init__(
        self,
        *,
        retention_s: float = DEFAULT_RETENTION_S,
        prune_interval_s: float = DEFAULT_PRUNE_INTERVAL_S,
        keepalive_s: float = DEFAULT_KEEPALIVE_S,
        clock: Callable[[], float] = time.time,
        hosted: HostedSettings | None = None,
    ) -> None:
        self.hosted = hosted
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
        self._service = ResponsesService(pool, store, background, keepalive_s=self.keepalive_s, clock=self._clock,
                                         hosted=self.hosted)

    async def stop(self) -> None:
        if self._service is not None:
            service, self._service = self._service, None
            await service.background.stop()

    async def context(self, app: web.Application) -> AsyncIterator[None]:
        """For ``app.cleanup_ctx``; registered after the pool's and the database's."""
        await self.start(app[appkeys.POOL], app[appkeys.DB])
        try:
            yield
        finally:
            await self.stop()


