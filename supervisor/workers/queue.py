"""One worker's requests: the FIFO of those waiting and the ones in flight.

``RequestQueue`` numbers each request, sends up to ``parallel`` of them at a
time while the handle lets it dispatch, routes the worker's answers to each
request's event queue and ends requests (one at a time or all at once). It
knows nothing of processes: it writes frames through a ``Transport``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from worker import protocol as p

log = logging.getLogger("gpuvisor.worker")


class WorkerGone(msgspec.Struct):
    """Terminal event for a request whose worker went away mid-request."""

    code: str  # worker_crashed | evicted | worker_stopped | model_failed
    message: str


class QueueFull(Exception):
    pass


@dataclass(eq=False)
class Pending:
    id: int
    msg: p.Generate | p.Embed | p.Tokenize
    events: asyncio.Queue[p.FromWorker | WorkerGone] = field(default_factory=asyncio.Queue)
    sent: bool = False
    finished: bool = False
    # Who asked (supervisor/api/callers.py): a crash is blamed on the callers in
    # flight (supervisor/workers/crash_keys.py). Empty: the parent's own request.
    caller: str = ""


class Transport(Protocol):
    def encode(self, msg: msgspec.Struct) -> bytes: ...

    def write(self, frame: bytes) -> None: ...


class RequestQueue:
    def __init__(self, model_id: str, parallel: int, limit: int, transport: Transport,
                 clock: Callable[[], float], changed: asyncio.Event,
                 dispatching: Callable[[], bool]) -> None:
        self.model_id = model_id
        self.parallel = parallel
        self.limit = limit
        self.transport = transport
        self.clock = clock
        self.changed = changed  # set on every request that ends or leaves
        self.waiting: deque[Pending] = deque()
        self.inflight: dict[int, Pending] = {}
        self.last_used = clock()
        # Whether requests may go to the worker now (the handle's state says).
        self.dispatching = dispatching
        self._ids = itertools.count(1)

    @property
    def busy(self) -> bool:
        return bool(self.inflight) or bool(self.waiting)

    @property
    def slots_full(self) -> bool:
        return len(self.inflight) >= max(1, self.parallel)

    def add(self, msg: p.Generate | p.Embed | p.Tokenize, ready: bool, caller: str = "") -> Pending:
        """Queue a request; full only when it would wait (``ready``: the worker runs)."""
        if len(self.waiting) >= self.limit and (self.slots_full or not ready):
            raise QueueFull(f"{len(self.waiting)} requests are already waiting for {self.model_id}")
        msg.id = next(self._ids)
        pend = Pending(msg.id, msg, caller=caller)
        self.waiting.append(pend)
        self.last_used = self.clock()
        self.kick()
        return pend

    def cancel(self, pend: Pending) -> None:
        if pend.finished:
            return
        if not pend.sent:
            self.waiting.remove(pend)
            pend.finished = True
            self.changed.set()
            return
        self.transport.write(self.transport.encode(p.Cancel(pend.id)))

    def kick(self) -> None:
        """Send waiting requests while slots are free."""
        while self.waiting and not self.slots_full and self.dispatching():
            self._send_next()

    def _send_next(self) -> None:
        pend = self.waiting.popleft()
        try:
            frame = self.transport.encode(pend.msg)
        except (OverflowError, p.FrameTooLarge) as exc:
            # Not sendable (an int beyond 64 bits, a frame over the limit):
            # answer this request alone, never hold the worker's slot for it.
            self.end(pend, p.Error(pend.id, "invalid_request", f"the request cannot be sent to the worker: {exc}"))
            return
        pend.sent = True
        self.inflight[pend.id] = pend
        self.transport.write(frame)

    def deliver(self, msg: p.FromWorker) -> None:
        """Route one of the worker's answers to its request."""
        match msg:
            case p.Started() | p.Delta():
                pend = self.inflight.get(msg.id)
                if pend is not None:
                    pend.events.put_nowait(msg)
            case p.Done() | p.Tokens() | p.Embeddings():
                pend = self.inflight.get(msg.id)
                if pend is not None:
                    self.end(pend, msg)
            case p.Error():
                pend = self.inflight.get(msg.id)
                if pend is not None:
                    self.end(pend, msg)
                else:
                    log.error("worker %s: %s: %s", self.model_id, msg.code, msg.message)
            case _:
                log.error("worker %s: unexpected %s", self.model_id, type(msg).__name__)

    def end(self, pend: Pending, event: p.FromWorker | WorkerGone) -> None:
        pend.finished = True
        pend.events.put_nowait(event)
        if self.inflight.get(pend.id) is pend:
            del self.inflight[pend.id]
        self.last_used = self.clock()
        self.changed.set()
        self.kick()

    def end_inflight(self, code: str, message: str) -> None:
        for pend in list(self.inflight.values()):
            self.end(pend, WorkerGone(code, message))

    def fail_all(self, code: str, reason: str) -> None:
        self.end_inflight(code, reason)
        while self.waiting:
            pend = self.waiting.popleft()
            pend.finished = True
            pend.events.put_nowait(WorkerGone(code, reason))
        self.changed.set()
