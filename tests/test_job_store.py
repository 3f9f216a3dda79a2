"""JobStore on a real SQLite file: submit/dedupe, claims, events, cancel,
delete, prune and boot recovery (with a real leftover process group)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from jobs.events import Log, Progress, Stage
from supervisor.db import Database
from supervisor.errors import Conflict, NotFound
from supervisor.lab.job_process import kill_leftover_group
from supervisor.lab.store import JOBS_MIGRATIONS, JOBS_SCHEMA, JobStore
from tests.jobsupport import FakeClock, open_store


async def test_submit_dedupes_identical_active_jobs(tmp_path: Path) -> None:
    async with open_store(tmp_path / "db.sqlite") as store:
        a, created_a = await store.submit("sleep", {"steps": 1, "tag": "x"})
        b, created_b = await store.submit("sleep", {"tag": "x", "steps": 1})
        c, created_c = await store.submit("sleep", {"steps": 2, "tag": "x"})
        assert created_a and not created_b and created_c
        assert a.id == b.id != c.id
        assert a.id.startswith("job_") and a.status == "queued"
        api = a.to_api()
        for key in ("id", "kind", "status", "progress", "stage", "message", "params", "result",
                    "error", "created_at", "started_at", "finished_at"):
            assert key in api
        picked = await store.next_queued()
        assert picked is not None and picked.id == a.id and picked.status == "queued"
        claimed = await store.start(a.id)
        assert claimed is not None and claimed.status == "running"
        assert await store.start(a.id) is None  # running already
        await store.finish(a.id, "succeeded", result={"ok": 1})
        # Finished jobs no longer block an identical submission.
        d, created_d = await store.submit("sleep", {"steps": 1, "tag": "x"})
        assert created_d and d.id != a.id


async def test_claim_order_priority_then_age(tmp_path: Path) -> None:
    clock = FakeClock()
    async with open_store(tmp_path / "db.sqlite", clock) as store:
        ids = []
        for i, prio in enumerate([0, 5, 0, 5]):
            clock.now += 1
            job, _ = await store.submit("sleep", {"tag": str(i)}, prio)
            ids.append(job.id)
        order = []
        first = await store.next_queued(exclude=[ids[1]])
        assert first is not None and first.id == ids[3]
        while (picked := await store.next_queued()) is not None:
            job = await store.start(picked.id)
            assert job is not None and job.status == "running" and job.attempt == 1
            order.append(job.id)
        assert order == [ids[1], ids[3], ids[0], ids[2]]


async def test_events_seq_progress_and_subscribers(tmp_path: Path) -> None:
    async with open_store(tmp_path / "db.sqlite") as store:
        job, _ = await store.submit("sleep", {})
        await store.start(job.id)
        with store.hub.subscribe(job.id) as sub:
            stored = await store.append_events(
                job.id,
                [Stage({"stage": "reading"}), Progress({"progress": 0.5, "message": "half"})],
            )
            assert [e.seq for e in stored] == [1, 2]
            assert [e.seq for e in sub.take()] == [1, 2]
            await store.append_events(job.id, [Log({"message": "hi"})])
            got = await store.get(job.id)
            assert (got.progress, got.stage, got.message) == (0.5, "reading", "hi")
            assert [e.seq for e in await store.events_after(job.id, 1)] == [2, 3]
            await store.finish(job.id, "succeeded", result={"n": 1})
            assert sub.ended
            last = sub.take()[-1]
            assert last.type == "status" and last.data["status"] == "succeeded"
        assert (await store.get(job.id)).progress == 1.0


async def test_cancel_queued_running_and_finished(tmp_path: Path) -> None:
    async with open_store(tmp_path / "db.sqlite") as store:
        queued, _ = await store.submit("sleep", {"tag": "q"})
        cancelled = await store.request_cancel(queued.id)
        assert cancelled.status == "cancelled" and cancelled.finished_at is not None
        assert (await store.request_cancel(queued.id)).status == "cancelled"
        running, _ = await store.submit("sleep", {"tag": "r"})
        await store.start(running.id)
        job = await store.request_cancel(running.id)
        assert job.status == "running" and job.cancel_requested_at is not None
        await store.finish(running.id, "succeeded")
        with pytest.raises(Conflict):
            await store.request_cancel(running.id)
        with pytest.raises(NotFound):
            await store.request_cancel("job_nope")


async def test_delete_only_finished(tmp_path: Path) -> None:
    async with open_store(tmp_path / "db.sqlite") as store:
        job, _ = await store.submit("sleep", {})
        with pytest.raises(Conflict):
            await store.delete(job.id)
        await store.request_cancel(job.id)
        await store.delete(job.id)
        with pytest.raises(NotFound):
            await store.get(job.id)
        assert await store.events_after(job.id, 0) == []


async def test_list_filters_and_cursor(tmp_path: Path) -> None:
    async with open_store(tmp_path / "db.sqlite") as store:
        ids = [(await store.submit("sleep", {"tag": str(i)}))[0].id for i in range(5)]
        await store.request_cancel(ids[0])
        page = await store.list_jobs(limit=2)
        assert [j.id for j in page.jobs] == [ids[4], ids[3]] and page.next_cursor
        page2 = await store.list_jobs(limit=2, cursor=page.next_cursor)
        assert [j.id for j in page2.jobs] == [ids[2], ids[1]]
        page3 = await store.list_jobs(limit=2, cursor=page2.next_cursor)
        assert [j.id for j in page3.jobs] == [ids[0]] and page3.next_cursor is None
        assert [j.id for j in (await store.list_jobs(status=["cancelled"])).jobs] == [ids[0]]
        assert (await store.list_jobs(kind="dataset")).jobs == []


async def test_prune_keeps_recent_and_active(tmp_path: Path) -> None:
    clock = FakeClock()
    async with open_store(tmp_path / "db.sqlite", clock) as store:
        old, _ = await store.submit("sleep", {"tag": "old"})
        await store.request_cancel(old.id)
        active, _ = await store.submit("sleep", {"tag": "active"})
        clock.now += 15 * 24 * 3600
        recent, _ = await store.submit("sleep", {"tag": "recent"})
        await store.request_cancel(recent.id)
        pruned = await store.prune()
        assert [j.id for j in pruned] == [old.id]
        left = {j.id for j in (await store.list_jobs()).jobs}
        assert left == {active.id, recent.id}
        assert await store.db.integrity_ok()


def _spawn_group() -> subprocess.Popen[bytes]:
    # A leader with a child in its own session, like a job process.
    code = "import subprocess,sys,time; subprocess.Popen([sys.executable,'-c','import time; time.sleep(60)']); time.sleep(60)"
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


async def test_boot_recovery_interrupts_and_kills_leftovers(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite"
    proc = _spawn_group()
    try:
        async with open_store(path) as store:
            running, _ = await store.submit("sleep", {"tag": "r"})
            waiting, _ = await store.submit("sleep", {"tag": "w"})
            await store.start(running.id)
            await store.set_stage(waiting.id, "waiting for device", "waiting for cpu")
            await asyncio.sleep(0.3)  # let the leader start its child
            ct = psutil.Process(proc.pid).create_time()
            await store.mark_running(running.id, pid=proc.pid, pgid=proc.pid, create_time=ct,
                                     log_path=str(tmp_path / "x.log"))
            members = [p.pid for p in psutil.process_iter() if _pgid(p.pid) == proc.pid]
            assert len(members) == 2
        # "Restart": a fresh connection on the same file.
        async with open_store(path) as store:
            report = await store.recover_at_boot()
            assert report.interrupted == [running.id] and report.killed_pids == [proc.pid]
            job = await store.get(running.id)
            assert job.status == "interrupted" and job.error == "supervisor restarted"
            still = await store.get(waiting.id)
            assert (still.status, still.stage, still.message, still.attempt) == ("queued", None, None, 0)
            assert await store.db.integrity_ok()
        proc.wait(timeout=5)
        deadline = time.monotonic() + 5
        while any(_alive(pid) for pid in members) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not any(_alive(pid) for pid in members)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_recovery_never_kills_a_stranger() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                            start_new_session=True)
    try:
        ct = psutil.Process(proc.pid).create_time()
        # Same pid, different create time: a reused pid is not ours.
        assert kill_leftover_group(proc.pid, proc.pid, ct - 100.0) == []
        assert proc.poll() is None
        assert kill_leftover_group(proc.pid, proc.pid, ct) == [proc.pid]
        assert proc.wait(timeout=5) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_schema_is_one_migration() -> None:
    assert all(isinstance(s, str) for s in JOBS_SCHEMA)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def test_owner_column_migrates_and_filters(tmp_path: Path) -> None:
    path = tmp_path / "gv.db"
    # A database from before the owner column: its jobs have no owner.
    old = Database(path, [JOBS_SCHEMA])
    await old.open()
    async with old.write() as conn:
        await conn.execute("INSERT INTO jobs (id, kind, status, params, created_at, unique_key) "
                           "VALUES ('job_before', 'sleep', 'succeeded', '{}', 1.0, 'k')")
    await old.close()
    db = Database(path, JOBS_MIGRATIONS)
    await db.open()
    try:
        store = JobStore(db)
        assert (await store.get("job_before")).owner is None
        a, _ = await store.submit("sleep", {"tag": "a"}, owner="key_a")
        b, _ = await store.submit("sleep", {"tag": "b"}, owner="key_b")
        assert a.owner == "key_a"
        assert [j.id for j in (await store.list_jobs(owner="key_a")).jobs] == [a.id]
        assert [j.id for j in (await store.list_jobs()).jobs] == [b.id, a.id, "job_before"]
        # Deduplication spans owners; the route refuses to show another key's job.
        again, created = await store.submit("sleep", {"tag": "a"}, owner="key_b")
        assert not created and again.id == a.id and again.owner == "key_a"
        assert "pid" in a.to_api() and not {"pid", "pgid", "log_path"} & set(a.to_api(admin=False))
    finally:
        await db.close()
