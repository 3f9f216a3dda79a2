"""The event log of a background response: followed live, kept in SQLite.

While a background response runs, :class:`LiveEvents` holds all of its
events in memory, wakes every client following it, and writes them to the
store in batches (at most ``flush_interval_s`` apart), so a generation is not
held up by a write per token. Its last events are stored with its final
state in one transaction (:meth:`LiveEvents.store_end`). A client attaches
with the sequence number it has seen and gets every later event; once the
response has finished (or the service restarted) the same events come from
the store. An event's sequence number is its position in the log: the
builder numbers them from 0 without gaps.

A full disk does not stop the log: refused events stay in memory, where
followers read them, and are written once the disk takes them again. What
the disk has refused is bounded (``max_unstored_bytes``): past it,
:meth:`LiveEvents.refusal` tells the generation to stop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable

from supervisor.db import RETRY_FIRST_S, RETRY_MAX_S, until_stored
from supervisor.errors import StorageFull
from supervisor.responses.events import Event
from supervisor.responses.objects import ResponseObject
from supervisor.responses.store import ResponseStore

log = logging.getLogger(__name__)

DEFAULT_FLUSH_INTERVAL_S = 0.25
# Events held for a disk that refuses them, before the generation stops.
DEFAULT_MAX_UNSTORED_BYTES = 8 << 20
TERMINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})


class LiveEvents:
    def __init__(self, response_id: str, store: ResponseStore, *,
                 flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
                 max_unstored_bytes: int = DEFAULT_MAX_UNSTORED_BYTES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.response_id = response_id
        self._store = store
        self._flush_interval_s = flush_interval_s
        self._max_unstored_bytes = max_unstored_bytes
        self._clock = clock
        self._events: list[Event] = []
        self._stored = 0
        self._unstored_bytes = 0
        self._next_flush = float("-inf")
        # Consecutive writes the full disk refused; they space out the retries.
        self._refusals = 0
        self._closed = False
        self._changed = asyncio.Event()
        # The finished response while the disk holds up storing it.
        self.final: ResponseObject | None = None

    async def add(self, events: list[Event]) -> None:
        """Log ``events``; they are stored when the next batch is due (a
        terminal one only with the final state, by :meth:`store_end`)."""
        if not events:
            return
        self._events += events
        self._unstored_bytes += sum(len(ev.data) for ev in events)
        self._wake()
        if self._clock() >= self._next_flush:
            await self.flush()

    async def flush(self) -> bool:
        """Store the events not stored yet; False if the full disk refused them
        (they stay here, and the next due batch tries again)."""
        pending = self._events[self._stored :]
        if pending and pending[-1].type in TERMINAL_EVENTS:
            # Stored only with the final state (store_end): a replay that ends
            # in a terminal event always belongs to a finished row.
            pending.pop()
        if not pending:
            return True
        try:
            await self._store.append_events(self.response_id, self._stored, pending)
        except StorageFull:
            self._refused()
            return False
        self._stored_up_to(self._stored + len(pending))
        return True

    async def store_end(self, resp: ResponseObject) -> None:
        """Store the events not stored yet with the final state ``resp``, in
        one transaction; StorageFull if the disk refused them."""
        upto = len(self._events)
        await self._store.finish(resp, self._stored, self._events[self._stored : upto])
        self._stored_up_to(upto)

    async def store_end_eventually(self, resp: ResponseObject) -> None:
        """:meth:`store_end`, retried while the disk is full (until cancelled);
        meanwhile :attr:`final` is the state waiting to be stored."""
        self.final = resp
        await until_stored(lambda: self.store_end(resp),
                           f"the end of background response {self.response_id} ({resp.status})")

    def refusal(self) -> StorageFull | None:
        """Why the generation must stop: the disk has refused more than the bound."""
        if self._refusals == 0 or self._unstored_bytes <= self._max_unstored_bytes:
            return None
        return StorageFull(f"the disk holding the database is full: {self._unstored_bytes} bytes of this "
                           "response's events could not be stored, so it was stopped")

    def _refused(self) -> None:
        if self._refusals == 0:
            log.warning("the disk is full: the events of background response %s are kept in memory "
                        "until it takes them", self.response_id)
        self._refusals += 1
        self._next_flush = self._clock() + min(RETRY_FIRST_S * 2 ** (self._refusals - 1), RETRY_MAX_S)

    def _stored_up_to(self, upto: int) -> None:
        self._unstored_bytes -= sum(len(ev.data) for ev in self._events[self._stored : upto])
        self._stored = upto
        self._next_flush = self._clock() + self._flush_interval_s
        if self._refusals:
            log.info("background response %s: its events are stored again", self.response_id)
            self._refusals = 0

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

    def __init__(self, store: ResponseStore, flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
                 max_unstored_bytes: int = DEFAULT_MAX_UNSTORED_BYTES) -> None:
        self._store = store
        self._flush_interval_s = flush_interval_s
        self.max_unstored_bytes = max_unstored_bytes
        self._logs: dict[str, LiveEvents] = {}

    def open(self, response_id: str) -> LiveEvents:
        live = LiveEvents(response_id, self._store, flush_interval_s=self._flush_interval_s,
                          max_unstored_bytes=self.max_unstored_bytes)
        self._logs[response_id] = live
        return live

    def get(self, response_id: str) -> LiveEvents | None:
        return self._logs.get(response_id)

    async def finish(self, response_id: str) -> None:
        """Store what is left (if the disk takes it) and close the log; later
        followers read the store."""
        live = self._logs.get(response_id)
        if live is None:
            return
        try:
            await live.flush()
        finally:
            live.close()
            del self._logs[response_id]

    async def follow(self, response_id: str, after: int) -> AsyncGenerator[Event, None]:
        """The events after ``after``: live while the response runs here, else stored."""
        live = self._logs.get(response_id)
        if live is not None:
            async for event in live.follow(after):
                yield event
            return
        for event in await self._store.events(response_id, after):
            yield event
