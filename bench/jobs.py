"""Lab benchmark: HTTP submits per second, events ingested per second from one
chatty job, and SSE latency from the job process writing an event to a client
receiving it. Everything is real: loopback HTTP, SQLite file, job processes.

Run: python -m bench.jobs [--submits 1000] [--events 100000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Self

import aiohttp
from aiohttp import web

from jobs.params import Roots
from supervisor.api.io import error_response
from supervisor.api.jobs import JobSettings, add_routes
from supervisor.appkeys import CONFIG, JOB_RUNNER, JOB_SETTINGS, JOB_STORE, LEASE
from supervisor.config import Config
from supervisor.db import Database
from supervisor.errors import ApiError
from supervisor.lab.lease import GpuLease, cpu_device
from supervisor.lab.runner import JobRunner, RunnerSettings
from supervisor.lab.store import JOBS_MIGRATIONS, JobStore

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
TARGET_SUBMITS = 500.0
TARGET_EVENTS = 5000.0


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(exc)


class Bench:
    def __init__(self, base: Path) -> None:
        self.roots = Roots(base / "models", base / "datasets", base / "outputs")
        for p in self.roots.all():
            p.mkdir(parents=True)
        self.db = Database(base / "state" / "gpuvisor.db", JOBS_MIGRATIONS)
        self.store = JobStore(self.db)
        self.lease = GpuLease([cpu_device()])
        self.runner = JobRunner(
            self.store, self.lease, RunnerSettings(state_dir=base / "state", roots=self.roots)
        )
        self.base = base
        self.url = ""
        self._web: web.AppRunner | None = None

    async def __aenter__(self) -> Self:
        await self.db.open()
        await self.runner.start()
        app = web.Application(middlewares=[_errors])
        app[CONFIG] = Config(state_dir=str(self.base / "state"))
        app[JOB_STORE], app[JOB_RUNNER], app[LEASE] = self.store, self.runner, self.lease
        app[JOB_SETTINGS] = JobSettings(self.roots, test_job_kinds=True)  # it benchmarks the sleep kind
        add_routes(app)
        self._web = web.AppRunner(app, access_log=None)
        await self._web.setup()
        site = web.TCPSite(self._web, "127.0.0.1", 0)
        await site.start()
        port = self._web.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._web is not None:
            await self._web.cleanup()
        await self.runner.stop()
        await self.db.close()

    async def wait_done(self, job_id: str) -> None:
        with self.store.hub.subscribe(job_id) as sub:
            while not (await self.store.get(job_id)).finished:
                await sub.wait(1.0)
                sub.take()


async def bench_submits(b: Bench, http: aiohttp.ClientSession, n: int, conc: int) -> float:
    # Hold the device so submitted jobs stay queued: this measures the API and
    # the store, not process start-up.
    await b.lease.acquire_job("job_bench_hold", "bench", ["cpu"], 0)
    counter = iter(range(n))

    async def client() -> None:
        for i in counter:
            body = {"kind": "sleep", "params": {"steps": 0, "tag": f"s{i}"}}
            async with http.post(f"{b.url}/api/jobs", json=body) as r:
                assert r.status == 201, await r.text()

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(conc)))
    rate = n / (time.perf_counter() - t0)
    for job in (await b.store.list_jobs(status=["queued", "running"], limit=n + 10)).jobs:
        await b.runner.cancel(job.id)
    b.lease.release_job("job_bench_hold")
    return rate


async def bench_events(b: Bench, n_events: int) -> tuple[float, float]:
    per_step = 1000
    from jobs.params import SleepParams

    params = SleepParams(steps=max(1, n_events // per_step), step_seconds=0, events_per_step=per_step,
                         tag="chatty")
    t0 = time.perf_counter()
    job, _ = await b.runner.submit("sleep", params)
    await b.wait_done(job.id)
    wall = time.perf_counter() - t0
    done = await b.store.get(job.id)
    assert done.status == "succeeded", done.error
    assert done.started_at is not None and done.finished_at is not None
    return done.last_seq / wall, done.last_seq / (done.finished_at - done.started_at)


async def bench_sse(b: Bench, http: aiohttp.ClientSession, steps: int) -> list[float]:
    body = {"kind": "sleep", "params": {"steps": steps, "step_seconds": 0.02, "tag": "sse"}}
    async with http.post(f"{b.url}/api/jobs", json=body) as r:
        job_id = (await r.json())["id"]
    lat: list[float] = []
    async with http.get(f"{b.url}/api/jobs/{job_id}/events") as resp:
        event = ""
        async for raw in resp.content:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: ") and event == "progress":
                t = json.loads(line[6:])["data"]["t"]
                lat.append((time.time() - t) * 1000)
            elif line.startswith("data: ") and event == "end":
                break
    return lat


async def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--submits", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--events", type=int, default=100_000)
    ap.add_argument("--sse-steps", type=int, default=100)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gvbench") as tmp:
        async with Bench(Path(tmp)) as b, aiohttp.ClientSession() as http:
            submits = await bench_submits(b, http, args.submits, args.concurrency)
            wall_rate, proc_rate = await bench_events(b, args.events)
            lat = sorted(await bench_sse(b, http, args.sse_steps))
    p50 = statistics.median(lat)
    p95 = lat[min(len(lat) - 1, int(len(lat) * 0.95))]
    print(f"submits/s over HTTP      {submits:10.0f}   target {TARGET_SUBMITS:.0f}  ratio {submits / TARGET_SUBMITS:.2f}")
    print(f"events/s ingested        {proc_rate:10.0f}   target {TARGET_EVENTS:.0f} ratio {proc_rate / TARGET_EVENTS:.2f}"
          f"   (incl. spawn: {wall_rate:.0f}/s)")
    print(f"SSE latency ms           p50 {p50:.1f}  p95 {p95:.1f}  max {lat[-1]:.1f}  (n={len(lat)})")


if __name__ == "__main__":
    try:
        import uvloop  # the parent runs on uvloop in production
    except ImportError:
        asyncio.run(main())
    else:
        uvloop.run(main())
