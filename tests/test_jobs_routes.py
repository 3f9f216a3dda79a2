"""The lab HTTP routes on a real loopback server, real SQLite, real jobs."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from jobs.kinds import job_kinds
from supervisor.api import schema as routes_schema
from supervisor.api.datasets import _dataset_files
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
        settings.setdefault("test_job_kinds", True)  # most tests here run the sleep kind
        app[JOB_SETTINGS] = JobSettings(lab.roots, **settings)
        add_routes(app)
        routes_schema.add_routes(app)
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
        # The first one waits for the device the blocker holds: queued too.
        queued = await (await http.get(f"{url}/api/jobs", params={"status": "queued"})).json()
        assert {j["id"] for j in queued["data"]} == set(ids)
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


async def test_sleep_kind_needs_the_test_setting(tmp_path: Path) -> None:
    async with lab_server(tmp_path, test_job_kinds=False) as (_lab, url), aiohttp.ClientSession() as http:
        r = await http.post(f"{url}/api/jobs", json={"kind": "sleep", "params": {"steps": 1}})
        err = (await r.json())["error"]
        assert r.status == 400 and err["param"] == "kind"
        assert "sleep" not in err["message"].partition("known:")[2]  # nor among the known kinds
        assert (await (await http.get(f"{url}/api/jobs")).json())["data"] == []
        schema = await (await http.get(f"{url}/api/jobs/schema")).json()
        assert "sleep" not in {k["kind"] for k in schema["data"]}
        assert {"finetune", "dataset"} <= {k["kind"] for k in schema["data"]}


async def test_schema_route_says_which_kinds_are_available(tmp_path: Path) -> None:
    async with lab_server(tmp_path) as (_lab, url), aiohttp.ClientSession() as http:
        body = await (await http.get(f"{url}/api/jobs/schema")).json()
    kinds = {k["kind"]: k for k in body["data"]}
    assert "sleep" in kinds  # this server has test_job_kinds on
    for k in kinds.values():
        assert isinstance(k["available"], bool) and isinstance(k["unavailable_reason"], str)
        assert k["available"] == (k["unavailable_reason"] == "")
    # The test machine has the train extra.
    assert kinds["finetune"]["available"] is True
    assert all(k["available"] for k in kinds.values())


def test_kind_schema_without_the_train_extra() -> None:
    body = routes_schema.all_schemas(missing_train=["torch", "peft"])
    kinds = {k["kind"]: k for k in body["data"]}
    assert kinds["finetune"]["available"] is False
    assert "torch, peft" in kinds["finetune"]["unavailable_reason"]
    assert "gpuvisor[train]" in kinds["finetune"]["unavailable_reason"]
    # Kinds that do not train stay available.
    for name in ("download", "export", "dataset", "quantize"):
        assert kinds[name]["available"] is True and kinds[name]["unavailable_reason"] == ""
    assert set(kinds) == set(job_kinds())


async def test_list_datasets(tmp_path: Path) -> None:
    async with lab_server(tmp_path) as (lab, url), aiohttp.ClientSession() as http:
        empty = await (await http.get(f"{url}/api/datasets")).json()
        assert empty == {"object": "list", "data": []}
        d = lab.roots.datasets
        (d / "old.jsonl").write_text("{}\n")
        (d / "new.csv").write_text("a,b\n1,2\n")
        os.utime(d / "old.jsonl", (1_600_000_000, 1_600_000_000))
        (d / ".upload-abc.tmp").write_text("in progress")
        (d / "sub").mkdir()
        secret = tmp_path / "secret.jsonl"
        secret.write_text("outside\n")
        (d / "link.jsonl").symlink_to(secret)
        body = await (await http.get(f"{url}/api/datasets")).json()
        assert body["object"] == "list"
        # Regular files only, newest first: no hidden, directory or symlink entries.
        assert [f["name"] for f in body["data"]] == ["new.csv", "old.jsonl"]
        assert body["data"][0]["bytes"] == len("a,b\n1,2\n")
        assert body["data"][1] == {"name": "old.jsonl", "bytes": 3, "modified": 1_600_000_000}


def test_dataset_listing_is_bounded(tmp_path: Path) -> None:
    for i in range(5):
        (tmp_path / f"d{i}.jsonl").write_text("x")
        os.utime(tmp_path / f"d{i}.jsonl", (1_600_000_000 + i, 1_600_000_000 + i))
    assert [f["name"] for f in _dataset_files(tmp_path, 2)] == ["d4.jsonl", "d3.jsonl"]


async def _raw_upload(url: str, body: bytes, boundary: str) -> tuple[int, dict[str, Any]]:
    """POST /api/datasets with exactly ``body`` (Content-Length matches it)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = (f"POST /api/datasets HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    writer.write(head + body)
    await writer.drain()
    raw = await reader.read()
    writer.close()
    status_line, _, rest = raw.partition(b"\r\n")
    payload = rest.partition(b"\r\n\r\n")[2]
    return int(status_line.split()[1]), json.loads(payload)


def _part(boundary: str, filename: str, data: bytes) -> bytes:
    return (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{filename}\"\r\n"
            "Content-Type: application/octet-stream\r\n\r\n").encode() + data


async def test_truncated_or_empty_upload_is_refused(tmp_path: Path) -> None:
    b = "gvBoundary42"
    rows = b'{"instruction": "q", "output": "a"}\n' * 3
    async with lab_server(tmp_path) as (lab, url):
        # Cut off inside the file's data, before any closing boundary.
        status, body = await _raw_upload(url, _part(b, "cut.jsonl", rows[:-10]), b)
        assert status == 400 and body["error"]["param"] == "file", body
        # Cut off right after the headers of the part: no data at all.
        status, body = await _raw_upload(url, _part(b, "cut0.jsonl", b""), b)
        assert status == 400 and body["error"]["param"] == "file", body
        # The file part ends, but the closing boundary never comes.
        status, body = await _raw_upload(url, _part(b, "cut2.jsonl", rows) + f"\r\n--{b}".encode(), b)
        assert status == 400 and body["error"]["param"] == "file", body
        # A complete body with an empty file.
        status, body = await _raw_upload(url, _part(b, "empty.jsonl", b"") + f"\r\n--{b}--\r\n".encode(), b)
        assert status == 400 and "empty" in body["error"]["message"], body
        assert list(lab.roots.datasets.iterdir()) == []
        # The same bodies, complete, are stored.
        status, body = await _raw_upload(url, _part(b, "ok.jsonl", rows) + f"\r\n--{b}--\r\n".encode(), b)
        assert status == 201 and body == {"name": "ok.jsonl", "bytes": len(rows)}, body
        assert (lab.roots.datasets / "ok.jsonl").read_bytes() == rows
        assert [p.name for p in lab.roots.datasets.iterdir()] == ["ok.jsonl"]
