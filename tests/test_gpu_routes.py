"""``GET /api/gpu`` and device params of ``POST /api/jobs`` on a simulated
2-GPU box: a real loopback server, real SQLite, real job processes."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from aiohttp import web
from aiohttp.test_utils import TestServer

from supervisor.api.jobs import JobSettings, add_routes
from supervisor.appkeys import CONFIG, JOB_RUNNER, JOB_SETTINGS, JOB_STORE, LEASE
from supervisor.config import Config
from supervisor.lab.lease import GpuLease, devices_from_readings
from supervisor.lab.runner import JobRunner, RunnerSettings
from supervisor.models.devices import RecordedSource, gpu_box
from supervisor.models.settle import Settler
from tests.jobsupport import make_roots, open_store, wait_finished, wait_for
from tests.test_jobs_routes import render_errors


@asynccontextmanager
async def gpu_lab(base: Path) -> AsyncIterator[tuple[JobRunner, str]]:
    box = gpu_box([20000, 9000])
    lease = GpuLease(devices_from_readings(box), settler=Settler(RecordedSource([box]), timeout=0.2))
    roots = make_roots(base)
    settings = RunnerSettings(state_dir=base / "state", roots=roots, python=sys.executable,
                              heartbeat_timeout_s=30.0, keepalive_s=0.5, stop_timeout_s=3.0)
    async with open_store(base / "state" / "gpuvisor.db") as store:
        runner = JobRunner(store, lease, settings)
        await runner.start()
        app = web.Application(middlewares=[render_errors])
        app[CONFIG] = Config(state_dir=str(base / "state"))
        app[JOB_STORE], app[JOB_RUNNER], app[LEASE] = store, runner, lease
        app[JOB_SETTINGS] = JobSettings(roots, test_job_kinds=True)
        add_routes(app)
        server = TestServer(app, host="127.0.0.1", port=0)
        await server.start_server()
        try:
            yield runner, str(server.make_url("")).rstrip("/")
        finally:
            await server.close()
            await runner.stop()


async def _submit(http: aiohttp.ClientSession, base: str, params: dict[str, Any]) -> tuple[int, Any]:
    async with http.post(f"{base}/api/jobs", json={"kind": "sleep", "params": params}) as resp:
        return resp.status, await resp.json()


async def test_gpu_state_shows_each_device_with_holder_waiters_and_memory(tmp_path: Path) -> None:
    async with gpu_lab(tmp_path) as (runner, base), aiohttp.ClientSession() as http:
        status, job = await _submit(http, base, {"steps": 400, "step_seconds": 0.05, "gpu_ids": ["1"]})
        assert status == 201
        running = await wait_for(runner.store, job["id"], lambda j: j.progress > 0)
        assert running.pid is not None
        assert psutil.Process(running.pid).environ()["CUDA_VISIBLE_DEVICES"] == "1"
        async with http.get(f"{base}/api/gpu") as resp:
            state = await resp.json()
        gpus = {d["id"]: d for d in state["devices"]}
        assert gpus["cuda:1"]["holder"]["job_id"] == job["id"] and gpus["cuda:1"]["waiters"] == []
        assert gpus["cuda:0"]["holder"] is None and gpus["cuda:0"]["why"] is None
        assert gpus["cuda:0"]["memory"] == {"free_mib": 20000, "total_mib": 24576}
        assert gpus["cuda:1"]["memory"] == {"free_mib": 9000, "total_mib": 24576}
        assert state["memory_error"] is None
        await runner.cancel(job["id"])
        assert (await wait_finished(runner.store, job["id"])).status == "cancelled"


async def test_devices_the_machine_lacks_are_a_400_naming_the_field(tmp_path: Path) -> None:
    async with gpu_lab(tmp_path) as (_runner, base), aiohttp.ClientSession() as http:
        status, body = await _submit(http, base, {"gpu_ids": ["cuda:5"]})
        assert status == 400 and body["error"]["param"] == "params.gpu_ids"
        status, body = await _submit(http, base, {"gpus": 3})
        assert status == 400 and body["error"]["param"] == "params.gpus"
        status, body = await _submit(http, base, {"gpus": 0})
        assert status == 400 and body["error"]["param"] == "params.gpus"
        status, _ = await _submit(http, base, {"gpus": 2, "steps": 1})
        assert status == 201
