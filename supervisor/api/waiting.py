"""Waiting for a device a job holds, instead of failing (supervisor/lab/busy.py).

- Every 503 ``gpu_busy`` gets ``error.job``: the job holding the device, its
  progress and an estimate of the time left, and how many jobs wait behind it.
- ``GET /api/models/{id}/wait?ticket=&timeout_s=`` long-polls (at most
  ``MAX_WAIT_S``) until model workers are admitted again: ``ready: true``, or
  the caller's ``position`` in line and the job it waits for. Pass the
  returned ``ticket`` on the next poll to keep the place.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from supervisor.api import user_view
from supervisor.api.auth import request_scope
from supervisor.api.callers import caller_of
from supervisor.api.io import json_response
from supervisor.appkeys import JOB_STORE, LEASE, POOL, WAIT_LINE
from supervisor.errors import BadRequest, DeviceBusy, ModelNotFound
from supervisor.lab.busy import WaitLine, busy_job, workers_admitted

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

MAX_WAIT_S = 25.0  # below common proxy read timeouts (30 s and up)
POLL_S = 0.25


@web.middleware
async def describe_busy(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Name the job in a 503 gpu_busy (the pool knows only the device's reason)."""
    try:
        return await handler(request)
    except DeviceBusy as busy:
        if busy.job is None and LEASE in request.app and JOB_STORE in request.app:
            store = request.app[JOB_STORE]
            busy.job = await busy_job(request.app[LEASE], store)
            scope = request_scope(request)
            if scope is not None:  # a user key: others' jobs unnamed
                await user_view.busy(busy, scope, user_view.owner_reader(store.get))
        raise


def _timeout(raw: str | None) -> float:
    if raw is None:
        return MAX_WAIT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= MAX_WAIT_S:  # also refuses nan
        raise BadRequest(f"timeout_s must be a number of seconds within 0..{MAX_WAIT_S:g}",
                         param="timeout_s")
    return value


async def wait_for_device(request: web.Request) -> web.Response:
    model = request.match_info["id"]
    if request.app[POOL].models.entry(model) is None:
        raise ModelNotFound(f"model '{model}' not found", param="model")
    timeout = _timeout(request.query.get("timeout_s"))
    line = request.app[WAIT_LINE]
    ticket = line.take(model, request.query.get("ticket") or None, caller_of(request))
    lease = request.app[LEASE]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not workers_admitted(lease):
        left = deadline - loop.time()
        if left <= 0:
            job = await busy_job(lease, request.app[JOB_STORE])
            jobs_waiting = job.jobs_waiting if job is not None else 0
            body: dict[str, Any] = {
                "ready": False, "ticket": ticket.id, "chats_ahead": line.ahead_of(ticket),
                "position": line.ahead_of(ticket) + jobs_waiting + 1, "job": job}
            return json_response(body)
        await asyncio.sleep(min(POLL_S, left))
    line.leave(ticket)
    return json_response({"ready": True, "ticket": ticket.id, "position": 0, "chats_ahead": 0, "job": None})


def setup(app: web.Application) -> None:
    """Before the models routes: their plain GET takes the whole path."""
    app[WAIT_LINE] = WaitLine()
    app.router.add_get("/api/models/{id:.+}/wait", wait_for_device)
