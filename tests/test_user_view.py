"""A user key sees its own work, not the machine's insides: no stack frames
or file paths in its failed job, no worker log, and another caller's job
holding the GPU only by its progress. The admin sees all of it."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from supervisor.api.user_view import OTHERS_JOB, scrub
from supervisor.models.demo import write_tiny_gguf
from tests.server import Server, poll_until, running, short_tempdir
from tests.test_auth import gpuvisor

ADMIN = "admin-token-for-user-view-tests-0123"
TRACE = ('job process exited with code 1 without finishing; log tail:\n'
         'Traceback (most recent call last):\n'
         '  File "/srv/gpuvisor/jobs/finetune.py", line 88, in run\n'
         '    model = load(params.base)\n'
         'OSError: cannot open /var/lib/gpuvisor/models/base/config.json')


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    models = short_tempdir("gvm")
    write_tiny_gguf(models / "tiny.gguf")
    with running(Server(models, env={"GPUVISOR_ADMIN_TOKEN": ADMIN})) as server:
        yield server


def _key(srv: Server, name: str) -> str:
    r = gpuvisor("keys", "add", name, "--state-dir", str(srv.state_dir))
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_scrub_cuts_frames_and_paths() -> None:
    out = scrub(TRACE)
    assert "File " not in out and "/var/lib" not in out and "/srv" not in out, out
    assert "OSError: cannot open config.json" in out and "log tail" in out, out


def test_a_user_key_sees_a_redacted_view(srv: Server) -> None:
    url, admin = srv.base_url, _auth(ADMIN)
    alice_token = _key(srv, "alice")
    alice = _auth(alice_token)
    alice_id = httpx.get(f"{url}/api/jobs", headers=alice, timeout=10)
    assert alice_id.status_code == 200
    from supervisor.api.auth import key_id_of
    owner = key_id_of(alice_token)
    with sqlite3.connect(srv.state_dir / "gpuvisor.db", timeout=10) as db:
        db.execute(
            "INSERT INTO jobs (id, kind, status, params, created_at, finished_at, unique_key, owner, error) "
            "VALUES ('job_00000000000000aa', 'sleep', 'failed', '{}', ?, ?, 'test:aa', ?, ?)",
            (time.time(), time.time(), owner, TRACE))
    mine = httpx.get(f"{url}/api/jobs/job_00000000000000aa", headers=alice, timeout=10).json()
    assert "File \"" not in mine["error"] and "/var/lib" not in mine["error"], mine["error"]
    assert "OSError" in mine["error"]
    full = httpx.get(f"{url}/api/jobs/job_00000000000000aa", headers=admin, timeout=10).json()
    assert full["error"] == TRACE

    # The admin's job holds the device: the user sees that a job does, not which.
    r = httpx.post(f"{url}/api/jobs", headers=admin, timeout=30, json={
        "kind": "sleep", "params": {"steps": 4000, "step_seconds": 0.05, "tag": "secret-admin-run"}})
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    try:
        poll_until(lambda: httpx.get(f"{url}/api/jobs/{job_id}", headers=admin, timeout=10).json()["status"],
                   lambda s: s == "running", timeout=60)
        seen = json.dumps(httpx.get(f"{url}/api/gpu", headers=alice, timeout=10).json())
        assert job_id not in seen and "secret-admin-run" not in seen and OTHERS_JOB in seen, seen
        assert job_id in json.dumps(httpx.get(f"{url}/api/gpu", headers=admin, timeout=10).json())
        refused = httpx.post(f"{url}/v1/chat/completions", headers=alice, timeout=60, json={
            "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert refused.status_code == 503, refused.text
        busy = refused.json()["error"]["job"]
        assert busy["id"] == "" and busy["kind"] == "" and busy["label"] == OTHERS_JOB, busy
        assert job_id not in refused.text and "secret-admin-run" not in refused.text, refused.text
        assert 0.0 <= busy["progress"] < 1.0
        theirs = httpx.post(f"{url}/v1/chat/completions", headers=admin, timeout=60, json={
            "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert theirs.json()["error"]["job"]["id"] == job_id
    finally:
        httpx.post(f"{url}/api/jobs/{job_id}/cancel", headers=admin, timeout=30)


def test_a_user_key_gets_no_worker_log(srv: Server, tmp_path: Path) -> None:
    alice = _auth(_key(srv, "alice2"))
    models = httpx.get(f"{srv.base_url}/api/models", headers=alice, timeout=10).json()["data"]
    assert all(m["log_tail"] is None for m in models)


def test_an_engine_error_reaches_a_user_key_without_the_engines_text(caplog: pytest.LogCaptureFixture) -> None:
    from supervisor.api.user_view import engine_error
    from supervisor.errors import BadRequest, UpstreamError
    raw = UpstreamError("std::bad_alloc in /opt/llama/src/llama-context.cpp", code="engine_error")
    with caplog.at_level("WARNING", logger="gpuvisor.api"):
        shown = engine_error(raw, "req_1")
    assert shown.status == 502 and shown.code == "engine_error"
    assert "bad_alloc" not in shown.message and "/opt" not in shown.message and "req_1" in shown.message
    assert "std::bad_alloc" in caplog.text  # the operator keeps the text, under the request id
    mine = BadRequest("max_tokens must be at least 1", param="max_tokens")
    assert engine_error(mine, "req_2") is mine  # the caller's own mistakes are theirs to read
