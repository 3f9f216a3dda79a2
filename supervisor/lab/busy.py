"""Inference refused while a job holds the device: who holds it, and a line to wait in.

A chat refused with 503 ``gpu_busy`` is told which job holds the device, how
far it is and roughly when it ends (:func:`busy_job`). The lab UI can then
wait instead of failing: it takes a ticket in the :class:`WaitLine` and
long-polls (``GET /api/models/{id}/wait``) until model workers are admitted
again. Its position counts the jobs queued for the device behind the holder
(the lease serves them first: they were there before) and the chats that took
a ticket earlier. Once workers are admitted, every waiting chat is told so:
they then share the device's slots like any other requests.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from jobs.errors import ParamError
from jobs.kinds import kind_spec, stored_params
from supervisor.errors import BusyJob, NotFound, TooManyPlaces, TooManyWaiting
from supervisor.lab.lease import GpuLease
from supervisor.lab.store import JobStore

# Progress below this gives no estimate: the first percent (loading, warm-up)
# says little about the rate of the rest.
MIN_PROGRESS_FOR_ETA = 0.01


def eta_seconds(progress: float, started_at: float | None, now: float) -> float | None:
    """Time left at the rate so far; None while there is too little to go by."""
    if started_at is None or not MIN_PROGRESS_FOR_ETA <= progress < 1.0:
        return None
    return round(max(0.0, now - started_at) * (1.0 - progress) / progress, 1)


def _held_device(snapshot: dict[str, Any]) -> dict[str, Any] | None:
    return next((d for d in snapshot["devices"] if d["holder"] is not None), None)


async def _jobs_behind(store: JobStore, device: str, lease_waiters: list[str]) -> int:
    """Jobs that will take ``device`` before a chat waiting now: those queued
    at the lease for it, and queued ones that need a device and have not been
    claimed yet (the runner claims them as slots free)."""
    behind = set(lease_waiters)
    # The first page is enough to count a line anyone would wait behind.
    for job in (await store.list_jobs(status=["queued"], limit=200)).jobs:
        try:
            if stored_params(kind_spec(job.kind), job.params).devices([device]):
                behind.add(job.id)
        except (ParamError, msgspec.ValidationError):
            continue  # a stored job of an unknown kind or bad params: it fails when claimed
    return len(behind)


async def busy_job(lease: GpuLease, store: JobStore, now: float | None = None) -> BusyJob | None:
    """The job holding (or being given) a device now, None when none does."""
    snapshot = lease.snapshot()
    device = _held_device(snapshot)
    if device is None:
        return None
    holder = device["holder"]
    lease_waiters = device.get("waiters", [w["job_id"] for w in snapshot["waiters"]])
    behind = await _jobs_behind(store, device["id"], lease_waiters)
    try:
        job = await store.get(holder["job_id"])
    except NotFound:
        # Ended between the two reads: the device is being handed on.
        return BusyJob(holder["job_id"], "", holder["label"], holder["state"], 1.0, None, behind)
    clock_now = time.time() if now is None else now
    return BusyJob(job.id, job.kind, holder["label"], holder["state"], job.progress,
                   eta_seconds(job.progress, job.started_at, clock_now), behind)


def workers_admitted(lease: GpuLease) -> bool:
    """Whether model workers may use some device of the lease now."""
    return any(lease.worker_admission(d) is None for d in lease.devices)


@dataclass
class Ticket:
    id: str
    model: str
    order: int
    seen_at: float
    holder: str  # the caller it was given to (supervisor/api/callers.py)


class WaitLine:
    """Chats waiting for a device, in the order they took their tickets.

    A ticket lapses when its chat stops polling for ``ttl_s`` (the tab was
    closed); the line holds at most ``max_tickets``, and one caller at most
    ``max_per_holder`` of them (one key once took all 1,000 in 0.7 s). A
    ticket is its caller's: another caller presenting it gets a place of
    its own at the back, not that one.
    """

    def __init__(self, *, ttl_s: float = 60.0, max_tickets: int = 1000, max_per_holder: int = 16,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_tickets = max_tickets
        self.max_per_holder = max_per_holder
        self._clock = clock
        self._tickets: dict[str, Ticket] = {}
        self._order = 0

    def take(self, model: str, ticket_id: str | None, holder: str) -> Ticket:
        """``holder``'s ticket, kept fresh; a new one at the back when it has none
        (or its old one lapsed, or the id is another caller's)."""
        now = self._clock()
        self._prune(now)
        ticket = self._tickets.get(ticket_id) if ticket_id else None
        if ticket is not None and ticket.holder == holder:
            ticket.seen_at = now
            ticket.model = model
            return ticket
        if len(self._tickets) >= self.max_tickets:
            raise TooManyWaiting(f"{self.max_tickets} chats are already waiting for the device")
        if sum(1 for t in self._tickets.values() if t.holder == holder) >= self.max_per_holder:
            raise TooManyPlaces(f"this caller already holds {self.max_per_holder} places in the line; "
                                 "poll with one of their tickets")
        self._order += 1
        ticket = Ticket("wt_" + secrets.token_hex(8), model, self._order, now, holder)
        self._tickets[ticket.id] = ticket
        return ticket

    def ahead_of(self, ticket: Ticket) -> int:
        """Chats that took their ticket before this one and still wait."""
        self._prune(self._clock())
        return sum(1 for t in self._tickets.values() if t.order < ticket.order)

    def leave(self, ticket: Ticket) -> None:
        self._tickets.pop(ticket.id, None)

    def __len__(self) -> int:
        return len(self._tickets)

    def _prune(self, now: float) -> None:
        for lapsed in [t.id for t in self._tickets.values() if now - t.seen_at > self.ttl_s]:
            del self._tickets[lapsed]
