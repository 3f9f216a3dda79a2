"""One worker's requests: the FIFO of those waiting and the ones in flight.

``RequestQueue`` numbers each request, sends up to ``parallel`` of them at a
time while the handle lets it dispatch, routes the worker's answers to each
request's event queue and ends requests (one at a time or all at once). It
knows nothing of processes: it writes frames through a ``Transport``.

Three rules keep one caller from pinning a model (supervisor/api/callers.py
says who a caller is):

- a request waits for a slot at most ``wait_limit`` seconds, counted while
  the worker serves (a load or a crash's restart stops the clock, and the
  restarted worker gives each waiting request its whole limit again); then
  it ends ``queue_timeout``;
- the next free slot goes to the oldest waiting request whose caller holds
  fewer than half the slots (rounded up), so another caller's request is
  served as soon as a slot frees, not after all of the first one's; when
  every waiting caller holds its share, the oldest is served (no slot idles);
- a full queue still takes a request from a caller with fewer waiting than
  another that holds more than half the places: that one's newest request
  gives up its place (``queue_full``), so one caller cannot fill the queue
  for everybody, yet has all of it while nobody else waits.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from worker import protocol as p

log = logging.getLogger("gpuvisor.worker")


class WorkerGone(msgspec.Struct):
    """Terminal event for a request whose worker went away mid-request."""

    code: str  # worker_crashed | evicted | worker_stopped | model_failed | queue_timeout | queue_full
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
    # Ends it with queue_timeout if it still waits then (armed once the worker serves).
    timer: asyncio.TimerHandle | None = None

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class Transport(Protocol):
    def encode(self, msg: msgspec.Struct) -> bytes: ...

    def write(self, frame: bytes) -> None: ...


class RequestQueue:
    def __init__(self, model_id: str, parallel: int, limit: int, transport: Transport,
                 clock: Callable[[], float], changed: asyncio.Event,
                 dispatching: Callable[[], bool], wait_limit: float = 0.0) -> None:
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
        # Seconds a request may wait for a slot (0 = no limit).
        self.wait_limit = wait_limit
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
            victim = self._displaced_by(caller)
            if victim is None:
                raise QueueFull(f"{len(self.waiting)} requests are already waiting for {self.model_id}")
            self._drop_waiting(victim, WorkerGone(
                "queue_full", f"the queue of {self.model_id} is full, and this caller held more than half "
                f"of its {self.limit} places while another waited; its newest request gave up its place"))
        msg.id = next(self._ids)
        pend = Pending(msg.id, msg, caller=caller)
        self.waiting.append(pend)
        self.last_used = self.clock()
        self.kick()
        return pend

    def _displaced_by(self, caller: str) -> Pending | None:
        """The waiting request that gives ``caller`` its place in a full queue, if any."""
        counts = Counter(pend.caller for pend in self.waiting)
        if not counts:
            return None
        heaviest, held = counts.most_common(1)[0]
        if heaviest == caller or held <= math.ceil(self.limit / 2) or counts[caller] + 1 >= held:
            return None
        return next(pend for pend in reversed(self.waiting) if pend.caller == heaviest)

    def _drop_waiting(self, pend: Pending, event: WorkerGone) -> None:
        """End a request that never reached the worker, with ``event``."""
        self.waiting.remove(pend)
        pend.disarm()
        pend.finished = True
        pend.events.put_nowait(event)
        self.changed.set()

    def cancel(self, pend: Pending) -> None:
        if pend.finished:
            return
        if not pend.sent:
            self.waiting.remove(pend)
            pend.disarm()
            pend.finished = True
            self.changed.set()
            return
        self.transport.write(self.transport.encode(p.Cancel(pend.id)))

    def kick(self) -> None:
        """Send waiting requests while slots are free; start the wait clock of
        those left, or stop it while the worker does not serve (a crash's
        restart, a load): the limit is on waiting for a busy model, and a
        restarted one gives each its whole limit again."""
        while self.waiting and not self.slots_full and self.dispatching():
            self._send_next()
        serving = self.dispatching()
        for pend in self.waiting:
            if not serving:
                pend.disarm()
            elif self.wait_limit > 0 and pend.timer is None:
                pend.timer = asyncio.get_running_loop().call_later(self.wait_limit, self._expire, pend)

    def _expire(self, pend: Pending) -> None:
        """A request waited its limit for a slot: it ends here, the others keep their places."""
        pend.timer = None
        if pend.finished or pend.sent:
            return
        log.warning("request %d on %s waited %g s for a slot: refused (queue_timeout)",
                    pend.id, self.model_id, self.wait_limit)
        self._drop_waiting(pend, WorkerGone(
            "queue_timeout", f"the request waited {self.wait_limit:g} s in the queue of {self.model_id} "
            f"while all {self.parallel} of its slots were busy; retry later"))

    def _next_index(self) -> int:
        """Where in the line the next request to send is (see the module's fairness rule)."""
        share = math.ceil(max(1, self.parallel) / 2)
        held = Counter(pend.caller for pend in self.inflight.values())
        for index, pend in enumerate(self.waiting):
            if held[pend.caller] < share:
                return index
        return 0

    def _send_next(self) -> None:
        index = self._next_index()
        pend = self.waiting[index]
        del self.waiting[index]
        pend.disarm()
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
        pend.disarm()
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
            pend.disarm()
            pend.finished = True
            pend.events.put_nowait(WorkerGone(code, reason))
        self.changed.set()
