"""The lab HTTP routes on a real loopback server, real SQLite, real jobs."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from supervisor.api.io import error_response
from supervisor.api.jobs import JobSettings, add_routes
from supervisor.appkeys import CONFIG, JOB_RUNNER, JOB_SETTINGS, JOB_STORE, LEASE
from supervisor.config import Config
from supervisor.errors import ApiError
from tests.jobsupport import Lab, running_lab, wait_finished, wait_for

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def render_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(exc)


@asynccontextmanager
async def lab_server(base: Path, **settings: Any) -> AsyncIterator[tuple[Lab, str]]:
    async with running_lab(base) as lab:
        app = web.Application(middlewares=[render_errors])
        app[CONFIG] = Config(state_dir=str(base / "state"))
        app[JOB_STORE] = lab.store
        app[JOB_RUNNER] = lab.runner
        app[LEASE] = lab.lease
        app[JOB_SETTINGS] = JobSettings(lab.roots, **settings)
        add_routes(app)
        server = TestServer(app, host="127.0.0.1", port=0)
        await server.start_server()
        try:
            yield lab, str(server.make_url("")).rstrip("/")
        finally:
            await server.close()


async def read_sse(resp: aiohttp.ClientResponse) -> list[dict[str, Any]]:
    """All SSE frames until ``event: end`` (comments kept as {"comment": ...})."""
    frames: list[dict[str, Any]] = []
    cur: dict[str, Any] = {}
    async for raw in resp.content:
        line = raw.decode().rstrip("\n")
        if not line:
            if cur:
                frames.append(cur)
                if cur.get("event") == "end":
                    return frames
            cur = {}
        elif line.startswith(":"):
            frames.append({"comment": line[1:].strip()})
        else:
            key, _, value = line.partition(": ")
            cur[key] = json.loads(value) if key == "data" else value
    return frames


async def test_submit_dedupe_and_validation(tmp_path: Path) -> None:
    async with lab_server(tmp_path) as (lab, url), aiohttp.ClientSession() as http:
        await lab.lease.acquire_job("job_blocker", "test", ["cpu"], 0)  # keep jobs from finishing
        body = {"kind": "sleep", "params": {"steps": 1, "tag": "a"}, "priority": 1}
        r1 = await http.post(f"{url}/api/jobs", json=body)
        assert r1.status == 201
        job = await r1.json()
        for key in ("id", "kind", "status", "progress", "stage", "message", "params", "result",
                    "error", "created_at", "started_at", "finished_at"):
            assert key in job
        r2 = await http.post(f"{url}/api/jobs", json=body)
        assert r2.status == 200 and (await r2.json())["id"] == job["id"]
        bad = await http.post(f"{url}/api/jobs", json={"kind": "sleep", "params": {"steps": -1}})
        assert bad.status == 400 and (await bad.json())["error"]["param"] == "params.steps"
        bad = await http.post(f"{url}/api/jobs", json={"kind": "nope"})
        assert bad.status == 400 and (await bad.json())["error"]["param"] == "kind"
        bad = await http.post(f"{url}/api/jobs",
                              json={"kind": "dataset", "params": {"input": "/etc/passwd"}})
        assert bad.status == 400 and (await bad.json())["error"]["param"] == "params.input"
        # The runner claims the job and queues it on the lease on its own time.
        for _ in range(200):
            gpu = await (await http.get(f"{url}/api/gpu")).json()
            if gpu["waiters"]:
                break
            await asyncio.sleep(0.02)
        assert gpu["devices"][0]["holder"]["job_id"] == "job_blocker"
        assert gpu["waiters"][0]["job_id"] == job["id"]
        assert "job_blocker" in gpu["devices"][0]["why"]
        # Delete while active: 409; cancel it, then delete.
        assert (await http.delete(f"{url}/api/jobs/{job['id']}")).status == 409
        cancelled = await (await http.post(f"{url}/api/jobs/{job['id']}/cancel")).json()
        assert cancelled["status"] in ("running", "cancelled")
        assert (await wait_finished(lab.store, job["id"])).status == "cancelled"
        assert (await http.delete(f"{url}/api/jobs/{job['id']}")).status == 200
        assert (await http.get(f"{url}/api/jobs/{job['id']}")).status == 404
        lab.lease.release_job("job_blocker")


async def test_list_filters_and_cursor(tmp_path: Path) -> None:
    async with lab_server(tmp_path) as (lab, url), aiohttp.ClientSession() as http:
        await lab.lease.acquire_job("job_blocker", "test", ["cpu"], 0)
        ids = []
        for i in range(3):
            r = await http.post(f"{url}/api/jobs", json={"kind": "sleep", "params": {"tag": str(i)}})
            ids.append((await r.json())["id"])
        page = await (await http.get(f"{url}/api/jobs", params={"limit": "2"})).json()
        assert [j["id"] for j in page["data"]] == ids[:0:-1]
        page2 = await (await http.get(f"{url}/api/jobs",
                                      params={"limit": "2", "cursor": page["next_cursor"]})).json()
        assert [j["id"] for j in page2["data"]] == ids[:1] and page2["next_cursor"] is None
        queued = await (await http.get(f"{url}/api/jobs", params={"status": "queued"})).json()
        assert {j["id"] for j in queued["data"]} == set(ids[1:])
        assert (await http.get(f"{url}/api/jobs", params={"status": "bogus"})).status == 400
        assert (await http.get(f"{url}/api/jobs", params={"limit": "0"})).status == 400
        for i in ids:
            await http.post(f"{url}/api/jobs/{i}/cancel")
        lab.lease.release_job("job_blocker")


async def test_sse_stream_replay_and_end(tmp_path: Path) -> None:
    async with lab_server(tmp_path, sse_heartbeat_s=0.2) as (_lab, url), aiohttp.ClientSession() as http:
        r = await http.post(f"{url}/api/jobs",
                            json={"kind": "sleep", "params": {"steps": 3, "step_seconds": 0.3}})
        job_id = (await r.json())["id"]
        async with http.get(f"{url}/api/jobs/{job_id}/events") as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            frames = await read_sse(resp)
        assert frames[0] == {"retry": "2000"}
        events = [f for f in frames if "id" in f and f.get("event") != "end"]
        seqs = [int(f["id"]) for f in events]
        assert seqs == list(range(1, len(seqs) + 1))
        assert events[0]["event"] == "started" and events[-1]["event"] == "status"
        assert any("comment" in f for f in frames)  # heartbeats during the slow steps
        end = frames[-1]
        assert end["event"] == "end" and end["data"]["status"] == "succeeded"
        # Reconnect with Last-Event-ID: only later events, then end again.
        async with http.get(f"{url}/api/jobs/{job_id}/events",
                            headers={"Last-Event-ID": "2"}) as resp:
            again = await read_sse(resp)
        replay = [int(f["id"]) for f in again if "id" in f and f.get("event") != "end"]
        assert replay == seqs[2:]
        assert (await http.get(f"{url}/api/jobs/job_nope/events")).status == 404


async def test_cancel_running_and_log(tmp_path: Path) -> None:
    async with lab_server(tmp_path) as (lab, url), aiohttp.ClientSession() as http:
        r = await http.post(f"{url}/api/jobs",
                            json={"kind": "sleep", "params": {"steps": 500, "step_seconds": 0.05}})
        job_id = (await r.json())["id"]
        await wait_for(lab.store, job_id, lambda j: j.progress > 0)
        r = await http.post(f"{url}/api/jobs/{job_id}/cancel")
        assert r.status == 200
        assert (await wait_finished(lab.store, job_id)).status == "cancelled"
        again = await http.post(f"{url}/api/jobs/{job_id}/cancel")
        assert again.status == 200
        r = await http.post(f"{url}/api/jobs",
                            json={"kind": "sleep", "params": {"crash": "exit", "steps": 2}})
        crash_id = (await r.json())["id"]
        done = await wait_finished(lab.store, crash_id)
        assert done.status == "failed" and done.exit_code == 3
        log = await (await http.get(f"{url}/api/jobs/{crash_id}/log")).text()
        assert "crashing on purpose" in log
        assert (await http.post(f"{url}/api/jobs/{crash_id}/cancel")).status == 409


async def test_upload_then_dataset_job(tmp_path: Path) -> None:
    async with lab_server(tmp_path, max_upload_bytes=10_000) as (lab, url), \
            aiohttp.ClientSession() as http:
        rows = "\n".join(json.dumps({"instruction": f"q{i}", "output": f"a{i}"}) for i in range(20))
        form = aiohttp.FormData()
        form.add_field("file", rows.encode(), filename="my data.jsonl")
        r = await http.post(f"{url}/api/datasets", data=form)
        assert r.status == 201
        up = await r.json()
        assert up == {"name": "my_data.jsonl", "bytes": len(rows.encode())}
        form = aiohttp.FormData()
        form.add_field("file", rows.encode(), filename="my data.jsonl")
        assert (await (await http.post(f"{url}/api/datasets", data=form)).json())["name"] == "my_data-1.jsonl"
        big = aiohttp.FormData()
        big.add_field("file", b"x" * 20_000, filename="big.jsonl")
        r = await http.post(f"{url}/api/datasets", data=big)
        assert r.status == 413
        bad = aiohttp.FormData()
        bad.add_field("file", b"x", filename="evil.sh")
        assert (await http.post(f"{url}/api/datasets", data=bad)).status == 400
        assert not list(lab.roots.datasets.glob(".upload-*"))

        r = await http.post(f"{url}/api/jobs", json={"kind": "dataset",
                                                    "params": {"input": up["name"], "seed": 1}})
        job_id = (await r.json())["id"]
        done = await wait_finished(lab.store, job_id)
        assert done.status == "succeeded", done.error
        result = (await (await http.get(f"{url}/api/jobs/{job_id}")).json())["result"]
        assert result["rows"]["train"] == 18 and result["rows"]["eval"] == 2
        templates = await (await http.get(f"{url}/api/dataset/templates")).json()
        assert {t["format"] for t in templates["data"]} == {"alpaca", "sharegpt", "messages", "text"}
