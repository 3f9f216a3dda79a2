"""Jobs are scoped to the key that created them; probes say ok or degraded.

Real servers with authentication on: an admin token and user API keys made
by ``gpuvisor keys add``.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from supervisor.api.auth import key_id_of
from tests.bad_models import engine_refused_gguf
from tests.server import Server, running, short_tempdir
from tests.test_auth import gpuvisor

ADMIN = "admin-token-for-scope-tests-0123456789"
ADMIN_ONLY = ("pid", "pgid", "log_path")


@pytest.fixture(scope="module")
def secured() -> Iterator[Server]:
    with running(Server(short_tempdir("gvm"), env={"GPUVISOR_ADMIN_TOKEN": ADMIN})) as srv:
        yield srv


def _key(srv: Server, name: str) -> str:
    r = gpuvisor("keys", "add", name, "--state-dir", str(srv.state_dir))
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _insert_job(srv: Server, job_id: str, owner: str) -> None:
    """A finished job owned by ``owner`` (user keys may not submit jobs themselves)."""
    with sqlite3.connect(srv.state_dir / "gpuvisor.db", timeout=10) as db:
        db.execute(
            "INSERT INTO jobs (id, kind, status, params, created_at, finished_at, unique_key, "
            "pid, pgid, log_path, owner) VALUES (?, 'sleep', 'succeeded', '{}', ?, ?, ?, 4242, 4242, "
            "'/var/lib/gpuvisor/logs/x.log', ?)",
            (job_id, time.time(), time.time(), f"test:{job_id}", owner))


def _events(url: str, job_id: str, headers: dict[str, str]) -> list[dict[str, Any]]:
    with httpx.stream("GET", f"{url}/api/jobs/{job_id}/events", headers=headers, timeout=10) as r:
        assert r.status_code == 200
        frames, cur = [], {}
        for line in r.iter_lines():
            if not line:
                if cur:
                    frames.append(cur)
                    if cur.get("event") == "end":
                        return frames
                cur = {}
            elif not line.startswith(":"):
                k, _, v = line.partition(": ")
                cur[k] = json.loads(v) if k == "data" else v
    return frames


def test_keys_see_only_their_own_jobs(secured: Server) -> None:
    url, admin = secured.base_url, _auth(ADMIN)
    alice_token, bob_token = _key(secured, "alice"), _key(secured, "bob")
    alice, bob = _auth(alice_token), _auth(bob_token)
    alice_id = key_id_of(alice_token)
    assert alice_id is not None
    r = httpx.post(f"{url}/api/jobs", headers=admin, json={"kind": "sleep", "params": {
        "steps": 4000, "step_seconds": 0.05, "use_device": False, "tag": "scope"}})
    assert r.status_code == 201, r.text
    admin_job = r.json()["id"]
    try:
        deadline = time.monotonic() + 30
        while (view := httpx.get(f"{url}/api/jobs/{admin_job}", headers=admin).json())["pid"] is None:
            assert time.monotonic() < deadline, view
            time.sleep(0.05)
        # The admin sees the process facts and who created the job.
        assert view["owner"] == "admin" and isinstance(view["pid"], int) and view["log_path"]
        _insert_job(secured, "job_alice0000001", alice_id)

        # A user key lists only its own jobs, without process facts.
        mine = httpx.get(f"{url}/api/jobs", headers=alice).json()["data"]
        assert [j["id"] for j in mine] == ["job_alice0000001"]
        assert mine[0]["owner"] == alice_id
        assert not any(f in mine[0] for f in ADMIN_ONLY)
        one = httpx.get(f"{url}/api/jobs/job_alice0000001", headers=alice)
        assert one.status_code == 200 and not any(f in one.json() for f in ADMIN_ONLY)
        end = _events(url, "job_alice0000001", alice)[-1]
        assert end["event"] == "end" and not any(f in end["data"] for f in ADMIN_ONLY)

        # Another key's job is not found, as a missing one is.
        for who, job_id in ((alice, admin_job), (bob, admin_job), (bob, "job_alice0000001")):
            for path in ("", "/events", "/log"):
                r = httpx.get(f"{url}/api/jobs/{job_id}{path}", headers=who)
                assert r.status_code == 404, (path, r.text)
                assert r.json()["error"]["code"] == "not_found"
        assert httpx.get(f"{url}/api/jobs", headers=bob).json()["data"] == []
        # Changing a job takes the admin role whoever owns it.
        assert httpx.post(f"{url}/api/jobs/job_alice0000001/cancel", headers=alice).status_code == 403
        assert httpx.delete(f"{url}/api/jobs/job_alice0000001", headers=bob).status_code == 403

        # The admin sees every job, with process facts.
        every = {j["id"]: j for j in httpx.get(f"{url}/api/jobs", headers=admin).json()["data"]}
        assert {admin_job, "job_alice0000001"} <= set(every)
        assert every["job_alice0000001"]["pid"] == 4242
        assert every["job_alice0000001"]["log_path"] == "/var/lib/gpuvisor/logs/x.log"
    finally:
        httpx.post(f"{url}/api/jobs/{admin_job}/cancel", headers=admin)


def _failed_model_server(env: dict[str, str]) -> Server:
    models = short_tempdir("gvm")
    engine_refused_gguf(models / "broken.gguf")
    srv = Server(models, env=env)
    srv.start(wait_ready=False)
    return srv


def test_healthz_is_degraded_with_a_failed_model() -> None:
    srv = _failed_model_server({})
    try:
        srv.wait_worker(lambda w: w["state"] == "failed", model="broken")
        r = httpx.get(srv.base_url + "/healthz", timeout=10)
        # Authentication off (loopback): the details are everyone's.
        assert r.status_code == 200 and r.json()["status"] == "degraded"
        assert r.json()["workers"][0]["state"] == "failed"
        # Authentication off: every job is visible, with its process facts.
        job = httpx.post(srv.base_url + "/api/jobs", json={"kind": "sleep", "params": {
            "steps": 1, "step_seconds": 0, "use_device": False}}).json()
        assert job["owner"] is None and "pid" in job and "log_path" in job
    finally:
        srv.cleanup()


def test_healthz_with_auth_on_says_only_ok_or_degraded() -> None:
    srv = _failed_model_server({"GPUVISOR_ADMIN_TOKEN": ADMIN})
    try:
        deadline = time.monotonic() + 30
        while (signed := httpx.get(srv.base_url + "/healthz", headers=_auth(ADMIN), timeout=10).json()
               )["status"] != "degraded":
            assert time.monotonic() < deadline, signed
            time.sleep(0.1)
        assert signed["workers"][0]["model"] == "broken"
        anonymous = httpx.get(srv.base_url + "/healthz", timeout=10)
        assert anonymous.status_code == 200
        # No model ids, pids or reasons for an anonymous caller; not a plain "ok".
        assert anonymous.json() == {"status": "degraded"}, anonymous.text
    finally:
        srv.cleanup()


def test_a_keys_only_deployment_is_warned_about_at_start() -> None:
    """Keys without an admin token make every key an admin: said at start."""
    warning = "no admin token: every key has admin rights"
    srv = Server(short_tempdir("gvm"))
    try:
        srv.start()
        assert warning not in srv.log_text()  # no keys: nothing to warn about
        _key(srv, "alice")
        srv.restart()
        assert warning in srv.log_text()
    finally:
        srv.cleanup()
    admin = Server(short_tempdir("gvm"), env={"GPUVISOR_ADMIN_TOKEN": ADMIN})
    try:
        admin.start()
        _key(admin, "bob")
        admin.restart()
        assert warning not in admin.log_text()
    finally:
        admin.cleanup()
