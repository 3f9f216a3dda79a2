"""Owned tasks: background responses and the retention pruner.

Every task started here is kept until it ends; :meth:`BackgroundTasks.stop`
cancels and awaits them all, so nothing outlives the app. A background
response learns *why* it was cancelled (a client's cancel or shutdown) from
:meth:`BackgroundTasks.cancel_requested`, and records the matching status.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Callable, Coroutine
from typing import Any

from supervisor.db import until_stored
from supervisor.errors import StorageFull, Unavailable
from supervisor.responses.store import ResponseStore

log = logging.getLogger(__name__)

DEFAULT_RETENTION_S = 30 * 24 * 3600.0
DEFAULT_PRUNE_INTERVAL_S = 3600.0
# Background responses generating at once; the others wait, stored as queued,
# and never meet the worker queue's bound (which would fail them).
DEFAULT_MAX_RUNNING = 4
# Background responses accepted and not finished; beyond it, 503 up front.
DEFAULT_MAX_ACCEPTED = 1000


class BackgroundTasks:
    def __init__(
        self,
        store: ResponseStore,
        *,
        retention_s: float = DEFAULT_RETENTION_S,
        prune_interval_s: float = DEFAULT_PRUNE_INTERVAL_S,
        clock: Callable[[], float] = time.time,
        max_running: int = DEFAULT_MAX_RUNNING,
        max_accepted: int = DEFAULT_MAX_ACCEPTED,
    ) -> None:
        self._store = store
        self._running = asyncio.Semaphore(max_running)
        self._max_accepted = max_accepted
        self._retention_s = retention_s
        self._prune_interval_s = prune_interval_s
        self._clock = clock
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._cancel_requested: set[str] = set()
        self._pruner: asyncio.Task[None] | None = None
        # Marks the responses a restart interrupted, if the full disk refused it at start.
        self._recovery: asyncio.Task[None] | None = None
        self._stopping = False

    async def start(self) -> None:
        unfinished = await self._store.unfinished()
        try:
            await self._interrupt(unfinished)
        except StorageFull:
            # A full disk must not stop the start: they are marked once it has
            # space (only these: the ones created meanwhile are this run's own).
            self._recovery = asyncio.create_task(
                until_stored(lambda: self._interrupt(unfinished),
                             f"the failed state of {len(unfinished)} interrupted background responses"),
                name="responses-recovery")
        if self._retention_s > 0:  # 0 keeps stored responses forever
            try:
                await self.prune_once()
            except StorageFull:
                log.warning("pruning stored responses needs disk space too; retrying next interval")
            self._pruner = asyncio.create_task(self._prune_loop(), name="responses-prune")

    async def _interrupt(self, unfinished: list[str]) -> None:
        interrupted = await self._store.interrupt_unfinished(unfinished)
        if interrupted:
            log.warning("marked %d unfinished background responses as failed (interrupted)", interrupted)

    async def stop(self) -> None:
        self._stopping = True
        tasks = list(self._tasks.values())
        tasks += [t for t in (self._pruner, self._recovery) if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        self._pruner = self._recovery = None

    # ------------------------------------------------------------ responses

    def check_capacity(self) -> None:
        """Refuse a new background response before anything is stored."""
        if len(self._tasks) >= self._max_accepted:
            raise Unavailable(f"{len(self._tasks)} background responses are already waiting or running",
                              retry_after=5, code="queue_full")

    def slot(self) -> asyncio.Semaphore:
        """Held while a background response generates."""
        return self._running

    def submit(self, response_id: str, work: Coroutine[Any, Any, None]) -> None:
        if self._stopping:
            work.close()
            raise RuntimeError("background responses are shutting down")
        task = asyncio.create_task(work, name=f"response-{response_id}")
        self._tasks[response_id] = task
        task.add_done_callback(lambda t: self._finished(response_id, t))

    def _finished(self, response_id: str, task: asyncio.Task[None]) -> None:
        self._tasks.pop(response_id, None)
        self._cancel_requested.discard(response_id)
        if not task.cancelled() and task.exception() is not None:
            log.error("background response %s crashed", response_id, exc_info=task.exception())

    def running(self, response_id: str) -> bool:
        return response_id in self._tasks

    def cancel_requested(self, response_id: str) -> bool:
        return response_id in self._cancel_requested

    async def cancel(self, response_id: str) -> bool:
        """Cancel a running background response and wait until it has recorded it."""
        task = self._tasks.get(response_id)
        if task is None:
            return False
        self._cancel_requested.add(response_id)
        task.cancel()
        await asyncio.wait([task])
        return True

    # ------------------------------------------------------------- retention

    async def prune_once(self, now: float | None = None) -> int:
        """Delete finished responses past the retention at ``now`` (default: the clock)."""
        removed = await self._store.prune((self._clock() if now is None else now) - self._retention_s)
        if removed:
            log.info("pruned %d stored responses older than the retention period", removed)
        return removed

    async def _prune_loop(self) -> None:
        while True:
            await asyncio.sleep(self._prune_interval_s)
            try:
                await self.prune_once()
            except (sqlite3.Error, StorageFull):
                # A busy or failing database must not stop later prunes.
                log.exception("pruning stored responses failed; retrying next interval")
