"""Shared fixtures-in-code for the job store, runner and route tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from jobs.params import Roots
from supervisor.db import Database
from supervisor.lab.lease import GpuLease, cpu_device
from supervisor.lab.runner import JobRunner, RunnerSettings
from supervisor.lab.store import JOBS_MIGRATIONS, Job, JobStore


class FakeClock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_roots(base: Path) -> Roots:
    roots = Roots(base / "models", base / "datasets", base / "outputs")
    for p in roots.all():
        p.mkdir(parents=True, exist_ok=True)
    return roots


@asynccontextmanager
async def open_store(path: Path, clock: FakeClock | None = None) -> AsyncIterator[JobStore]:
    db = Database(path, JOBS_MIGRATIONS)
    await db.open()
    try:
        yield JobStore(db, clock) if clock is not None else JobStore(db)
    finally:
        await db.close()


@dataclass
class Lab:
    store: JobStore
    lease: GpuLease
    runner: JobRunner
    roots: Roots
    settings: RunnerSettings


@asynccontextmanager
async def running_lab(base: Path, **settings: object) -> AsyncIterator[Lab]:
    """A store, a cpu lease and a started runner on a real database file."""
    roots = make_roots(base)
    opts: dict[str, object] = {"heartbeat_timeout_s": 30.0, "keepalive_s": 0.5, "stop_timeout_s": 3.0}
    opts.update(settings)
    cfg = RunnerSettings(state_dir=base / "state", roots=roots, **opts)  # type: ignore[arg-type]
    async with open_store(base / "state" / "gpuvisor.db") as store:
        lease = GpuLease([cpu_device()])
        runner = JobRunner(store, lease, cfg)
        await runner.start()
        try:
            yield Lab(store, lease, runner, roots, cfg)
        finally:
            await runner.stop()


async def wait_finished(store: JobStore, job_id: str, timeout: float = 30.0) -> Job:
    """Wait for the job's end through the event hub (no polling loop)."""
    with store.hub.subscribe(job_id) as sub:
        job = await store.get(job_id)
        async with asyncio.timeout(timeout):
            while not job.finished:
                await sub.wait(timeout)
                sub.take()
                job = await store.get(job_id)
    return job


async def wait_for(store: JobStore, job_id: str, pred: Callable[[Job], bool],
                   timeout: float = 30.0) -> Job:
    """Wait until ``pred(job)`` holds, woken by the job's events."""
    with store.hub.subscribe(job_id) as sub:
        async with asyncio.timeout(timeout):
            while not pred(job := await store.get(job_id)):
                await sub.wait(0.2)
                sub.take()
    return job
