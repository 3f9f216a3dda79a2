"""In-process fan-out of stored job events to live subscribers (SSE).

The store publishes every batch of events right after its transaction commits,
so a subscriber sees an event only once it is durable. Each subscriber has its
own bounded queue; one that falls behind is marked ``lagged`` and catches up
from the database instead of holding an unbounded backlog in memory.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import msgspec


class StoredEvent(msgspec.Struct):
    """One durable job event; ``seq`` counts from 1 per job."""

    seq: int
    time: float
    type: str
    data: dict[str, Any]


class Subscription:
    """Live events of one job, in order; ``ended`` once the job is finished."""

    def __init__(self, job_id: str, max_backlog: int) -> None:
        self.job_id = job_id
        self.lagged = False
        self.ended = False
        self._max_backlog = max_backlog
        self._backlog: list[StoredEvent] = []
        self._changed = asyncio.Event()

    def _push(self, events: Sequence[StoredEvent]) -> None:
        if len(self._backlog) + len(events) > self._max_backlog:
            # Too slow a reader: drop the backlog, it re-reads from the database.
            self._backlog.clear()
            self.lagged = True
        else:
            self._backlog.extend(events)
        self._changed.set()

    def _end(self) -> None:
        self.ended = True
        self._changed.set()

    def take(self) -> list[StoredEvent]:
        """Everything queued so far (possibly nothing); clears the lag flag."""
        out, self._backlog = self._backlog, []
        self.lagged = False
        self._changed.clear()
        return out

    async def wait(self, timeout: float) -> bool:
        """True when something arrived (events, lag or end) within timeout."""
        if self._backlog or self.lagged or self.ended:
            return True
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except TimeoutError:
            return False
        return True


class JobEventHub:
    """Subscribers per job id; owned by the job store."""

    def __init__(self, max_backlog: int = 10_000) -> None:
        self._max_backlog = max_backlog
        self._subs: dict[str, set[Subscription]] = {}

    @contextmanager
    def subscribe(self, job_id: str) -> Iterator[Subscription]:
        sub = Subscription(job_id, self._max_backlog)
        self._subs.setdefault(job_id, set()).add(sub)
        try:
            yield sub
        finally:
            subs = self._subs.get(job_id)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del self._subs[job_id]

    def publish(self, job_id: str, events: Sequence[StoredEvent]) -> None:
        for sub in self._subs.get(job_id, ()):
            sub._push(events)

    def end(self, job_id: str) -> None:
        for sub in self._subs.get(job_id, ()):
            sub._end()

    def subscriber_count(self, job_id: str) -> int:
        return len(self._subs.get(job_id, ()))
