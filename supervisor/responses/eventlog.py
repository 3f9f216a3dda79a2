"""The event log of a background response: followed live, kept in SQLite.

While a background response runs, :class:`LiveEvents` holds all of its
events in memory, wakes every client following it, and writes them to the
store in batches (at most ``flush_interval_s`` apart, and at once for the
terminal event), so a generation is not held up by a write per token. A
client attaches with the sequence number it has seen and gets every later
event; once the response has finished (or the service restarted) the same
events come from the store. An event's sequence number is its position in
the log: the builder numbers them from 0 without gaps.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable

from supervisor.responses.events import Event
from supervisor.responses.store import ResponseStore

DEFAULT_FLUSH_INTERVAL_S = 0.25
TERMINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})


class LiveEvents:
    def __init__(self, response_id: str, store: ResponseStore, *,
                 flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.response_id = response_id
        self._store = store
        self._flush_interval_s = flush_interval_s
        self._clock = clock
        self._events: list[Event] = []
        self._stored = 0
        self._flushed_at = float("-inf")
        self._closed = False
        self._changed = asyncio.Event()

    async def add(self, events: list[Event]) -> None:
        if not events:
            return
        self._events += events
        self._wake()
        terminal = any(ev.type in TERMINAL_EVENTS for ev in events)
        if terminal or self._clock() - self._flushed_at >= self._flush_interval_s:
            await self.flush()

    async def flush(self) -> None:
        pending = self._events[self._stored :]
        if not pending:
            return
        await self._store.append_events(self.response_id, self._stored, pending)
        self._stored += len(pending)
        self._flushed_at = self._clock()

    def close(self) -> None:
        """No more events: followers end once they have read every one."""
        self._closed = True
        self._wake()

    def _wake(self) -> None:
        # Every waiter holds the event it waits on; a fresh one for the next round.
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, after: int) -> AsyncGenerator[Event, None]:
        """Every event after sequence number ``after``, as it comes, until the log closes."""
        index = max(0, after + 1)
        while True:
            while index < len(self._events):
                yield self._events[index]
                index += 1
            if self._closed:
                return
            await self._changed.wait()


class LiveLogs:
    """The logs of the background responses running in this process."""

    def __init__(self, store: ResponseStore, flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S) -> None:
        self._store = store
        self._flush_interval_s = flush_interval_s
        self._logs: dict[str, LiveEvents] = {}

    def open(self, response_id: str) -> LiveEvents:
        log = LiveEvents(response_id, self._store, flush_interval_s=self._flush_interval_s)
        self._logs[response_id] = log
        return log

    def get(self, response_id: str) -> LiveEvents | None:
        return self._logs.get(response_id)

    async def finish(self, response_id: str) -> None:
        """Store what is left and close the log; later followers read the store."""
        log = self._logs.get(response_id)
        if log is None:
            return
        try:
            await log.flush()
        finally:
            log.close()
            del self._logs[response_id]

    async def follow(self, response_id: str, after: int) -> AsyncGenerator[Event, None]:
        """The events after ``after``: live while the response runs here, else stored."""
        log = self._logs.get(response_id)
        if log is not None:
            async for event in log.follow(after):
                yield event
            return
        for event in await self._store.events(response_id, after):
            yield event
