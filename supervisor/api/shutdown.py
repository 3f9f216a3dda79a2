"""Graceful shutdown, run from ``app.on_shutdown`` (after the listener closed).

New requests on kept-alive connections get 503; in-flight generations may
finish within ``shutdown_timeout`` and are then ended with a
``shutting_down`` error event (a clean end of the stream, not a cut
connection); running jobs are asked to checkpoint and stop (their grace),
all at the same time. A second SIGTERM/SIGINT (``hurry``) stops the workers
and kills the jobs at once. The cleanup contexts then stop what is left and close the database.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from supervisor.appkeys import CONFIG, JOB_RUNNER, POOL, SHUTDOWN
from supervisor.errors import Unavailable

log = logging.getLogger("gpuvisor.shutdown")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ALWAYS_OPEN = frozenset({"/healthz", "/readyz"})
REASON = "the service is shutting down"


class ShutdownState:
    def __init__(self) -> None:
        self.draining = False
        self.hurry = asyncio.Event()


def waiting_line(requests: int, jobs: int, bound: float, job_grace: float) -> str:
    """The one line a stop logs: what it waits for, how long, and how to cut it short."""
    waits = []
    if requests:
        waits.append(f"up to {bound:g}s for {_count(requests, 'open request', 'open requests')} "
                     "(streams included) to finish")
    if jobs:
        waits.append(f"up to {job_grace:g}s for {_count(jobs, 'job', 'jobs')} to checkpoint and stop")
    if not waits:
        return "shutting down: no open requests or jobs to wait for"
    return (f"shutting down: waiting {' and '.join(waits)}; press Ctrl-C again (or send a second SIGTERM) "
            "to stop now")


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


@web.middleware
async def refuse_while_draining(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.app[SHUTDOWN].draining and request.path not in ALWAYS_OPEN:
        raise Unavailable(REASON, retry_after=5, code="shutting_down")
    return await handler(request)


async def drain(app: web.Application) -> None:
    """on_shutdown: drain workers and stop jobs together, within their bounds."""

    state = app[SHUTDOWN]
    state.draining = True
    pool = app.get(POOL)
    runner = app.get(JOB_RUNNER)
    if pool is None or runner is None:
        return  # startup failed before the lab existed; the contexts unwind it
    cfg = app[CONFIG]
    bound = cfg.shutdown_timeout
    handles = list(pool.handles.values())
    log.info("%s", waiting_line(sum(len(h.inflight) + len(h.queue) for h in handles),
                                len(runner.running()), bound, cfg.job_grace_s))
    # The handles stay in the pool (its cleanup context stops them again, a
    # no-op by then); this middleware keeps new requests from reaching them.
    drains = [h.drain(bound, REASON, "shutting_down") for h in handles]
    work: asyncio.Future[Any] = asyncio.gather(*drains, runner.stop())
    hurry: asyncio.Future[Any] = asyncio.ensure_future(state.hurry.wait())
    try:
        await asyncio.wait({work, hurry}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            log.warning("second signal: stopping workers and jobs now")
            runner.hurry()
            await asyncio.gather(*(h.stop(REASON, "shutting_down") for h in handles))
        await work
    finally:
        hurry.cancel()
