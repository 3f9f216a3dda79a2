"""JobRunner with real job processes, a real database file and a cpu lease."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
from pathlib import Path

import msgspec
import psutil

from jobs.context import EXIT_STOPPED
from jobs.events import Done, Failed, Log, Progress, Stage
from supervisor.lab.job_process import EventFramer, group_alive
from supervisor.lab.store import JOBS_MIGRATIONS
from tests.jobsupport import open_store, running_lab, wait_finished, wait_for

REPO = Path(__file__).resolve().parent.parent


def _gone(pid: int | None) -> bool:
    assert pid is not None
    return not group_alive(pid)


async def test_sleep_job_succeeds_with_events(tmp_path: Path) -> None:
    async with running_lab(tmp_path) as lab:
        p = lab.runner
        from jobs.params import SleepParams

        job, created = await p.submit("sleep", SleepParams(steps=3, step_seconds=0.01))
        assert created
        done = await wait_finished(lab.store, job.id)
        assert done.status == "succeeded", done.error
        assert done.result == {"steps": 3, "events": 3}
        assert done.progress == 1.0 and done.exit_code == 0 and done.pid
        types = [e.type for e in await lab.store.events_after(job.id, 0)]
        assert types[0] == "started" and types[-2:] == ["done", "status"]
        assert types.count("progress") == 3
        assert _gone(done.pgid)
        assert lab.lease.worker_admission("cpu") is None


async def test_cancel_queued_job(tmp_path: Path) -> None:
    from jobs.params import SleepParams

    async with running_lab(tmp_path) as lab:
        long, _ = await lab.runner.submit("sleep", SleepParams(steps=400, step_seconds=0.05))
        await wait_for(lab.store, long.id, lambda j: j.pid is not None)
        queued, _ = await lab.runner.submit("sleep", SleepParams(tag="queued"))
        got = await lab.runner.cancel(queued.id)
        assert got.status == "cancelled"
        await lab.runner.cancel(long.id)
        assert (await wait_finished(lab.store, long.id)).status == "cancelled"


async def test_cancel_running_job_stops_at_step_boundary(tmp_path: Path) -> None:
    from jobs.params import SleepParams

    async with running_lab(tmp_path) as lab:
        job, _ = await lab.runner.submit("sleep", SleepParams(steps=400, step_seconds=0.05))
        running = await wait_for(lab.store, job.id, lambda j: j.progress > 0)
        assert lab.lease.worker_admission("cpu") is not None
        await lab.runner.cancel(job.id)
        done = await wait_finished(lab.store, job.id)
        assert done.status == "cancelled" and done.exit_code == EXIT_STOPPED
        assert _gone(running.pgid)
        assert lab.lease.worker_admission("cpu") is None


async def test_cancel_escalates_to_sigkill_after_grace(tmp_path: Path) -> None:
    from jobs.params import SleepParams

    async with running_lab(tmp_path, grace_s={"sleep": 0.5}) as lab:
        params = SleepParams(steps=400, step_seconds=0.05, ignore_term=True)
        job, _ = await lab.runner.submit("sleep", params)
        await wait_for(lab.store, job.id, lambda j: j.progress > 0)
        await lab.runner.cancel(job.id)
        done = await wait_finished(lab.store, job.id)
        assert done.status == "cancelled" and done.exit_code == -signal.SIGKILL
        assert _gone(done.pgid)


async def test_sigkilled_job_fails_with_exit_code_and_log_tail(tmp_path: Path) -> None:
    from jobs.params import SleepParams

    async with running_lab(tmp_path) as lab:
        job, _ = await lab.runner.submit("sleep", SleepParams(steps=400, step_seconds=0.05))
        running = await wait_for(lab.store, job.id, lambda j: j.progress > 0)
        assert running.pid is not None
        os.kill(running.pid, signal.SIGKILL)
        done = await wait_finished(lab.store, job.id)
        assert done.status == "failed" and done.exit_code == -signal.SIGKILL
        assert done.error is not None and "SIGKILL" in done.error

        crash, _ = await lab.runner.submit("sleep", SleepParams(steps=3, crash="exit", crash_at_step=1))
        done = await wait_finished(lab.store, crash.id)
        assert done.status == "failed" and done.exit_code == 3
        assert done.error is not None and "crashing on purpose" in done.error


async def test_hung_job_is_killed_after_heartbeat_timeout(tmp_path: Path) -> None:
    from jobs.params import SleepParams

    async with running_lab(tmp_path, heartbeat_timeout_s=1.0) as lab:
        job, _ = await lab.runner.submit("sleep", SleepParams(steps=5, crash="stop", crash_at_step=1))
        done = await wait_finished(lab.store, job.id)
        assert done.status == "failed" and done.error is not None
        assert "no events" in done.error and done.exit_code == -signal.SIGKILL
        assert _gone(done.pgid)


async def test_job_waits_for_the_lease(tmp_path: Path) -> None:
    from jobs.params import SleepParams

    async with running_lab(tmp_path) as lab:
        await lab.lease.acquire_job("job_other", "test", ["cpu"], 0)
        job, _ = await lab.runner.submit("sleep", SleepParams(steps=1, step_seconds=0))
        waiting = await wait_for(lab.store, job.id, lambda j: j.stage == "waiting for device")
        # Queued until it holds the device; the stage says what it waits for.
        assert waiting.status == "queued" and waiting.pid is None and waiting.attempt == 0
        assert waiting.message == "waiting for cpu"
        assert lab.lease.snapshot()["waiters"][0]["job_id"] == job.id
        lab.lease.release_job("job_other")
        assert (await wait_finished(lab.store, job.id)).status == "succeeded"


async def test_cancel_while_waiting_for_the_lease(tmp_path: Path) -> None:
    from jobs.params import SleepParams

    async with running_lab(tmp_path) as lab:
        await lab.lease.acquire_job("job_other", "test", ["cpu"], 0)
        job, _ = await lab.runner.submit("sleep", SleepParams(steps=1))
        await wait_for(lab.store, job.id, lambda j: j.stage == "waiting for device")
        await lab.runner.cancel(job.id)
        done = await wait_finished(lab.store, job.id)
        assert done.status == "cancelled" and done.pid is None
        assert lab.lease.snapshot()["waiters"] == []
        lab.lease.release_job("job_other")


async def test_shutdown_leaves_a_job_waiting_for_the_lease_queued(tmp_path: Path) -> None:
    from jobs.params import SleepParams

    async with running_lab(tmp_path) as lab:
        await lab.lease.acquire_job("job_other", "test", ["cpu"], 0)
        job, _ = await lab.runner.submit("sleep", SleepParams(steps=1))
        await wait_for(lab.store, job.id, lambda j: j.stage == "waiting for device")
        await lab.runner.stop()
        after = await lab.store.get(job.id)
        assert (after.status, after.attempt, after.pid) == ("queued", 0, None)
        assert lab.lease.snapshot()["waiters"] == []
        lab.lease.release_job("job_other")


async def test_runner_stop_interrupts_running_jobs(tmp_path: Path) -> None:
    from jobs.params import SleepParams

    async with running_lab(tmp_path) as lab:
        job, _ = await lab.runner.submit("sleep", SleepParams(steps=400, step_seconds=0.05))
        running = await wait_for(lab.store, job.id, lambda j: j.progress > 0)
        await lab.runner.stop()
        done = await lab.store.get(job.id)
        assert done.status == "interrupted" and done.error == "supervisor shut down"
        assert _gone(running.pgid)


PARENT = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from jobs.params import SleepParams
    from tests.jobsupport import running_lab, wait_for

    async def main() -> None:
        async with running_lab(Path(sys.argv[1])) as lab:
            job, _ = await lab.runner.submit("sleep", SleepParams(steps=1000, step_seconds=0.05))
            job = await wait_for(lab.store, job.id, lambda j: j.progress > 0)
            print(job.id, job.pid, flush=True)
            await asyncio.sleep(60)

    asyncio.run(main())
    """
)


async def test_parent_sigkill_then_restart_marks_interrupted(tmp_path: Path) -> None:
    parent = await asyncio.create_subprocess_exec(
        sys.executable, "-c", PARENT, str(tmp_path), cwd=REPO, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert parent.stdout is not None
        line = await asyncio.wait_for(parent.stdout.readline(), 30)
        job_id, pid = line.decode().split()
        assert psutil.pid_exists(int(pid))
        parent.kill()
        await parent.wait()
    finally:
        if parent.returncode is None:
            parent.kill()
            await parent.wait()
    async with running_lab(tmp_path) as lab:
        job = await lab.store.get(job_id)
        assert job.status == "interrupted" and job.error == "supervisor restarted"
        assert await lab.store.db.integrity_ok()
    # The orphan saw its stdin close and exited, or recovery killed it.
    assert _gone(int(pid))


def test_framer_survives_garbage_and_long_lines() -> None:
    framer = EventFramer(max_line_bytes=100)
    out = framer.feed(b'{"type":"log","data":{"message":"a"}}\n\nnot json\n{"type":"bogus"}\n')
    assert out.keepalives == 1
    assert [type(e) for e in out.events] == [Log, Log, Log]
    assert "malformed" in out.events[1].data["message"]
    out = framer.feed(b"x" * 150)
    assert "dropped" in out.events[0].data["message"]
    out = framer.feed(b'yyy\n{"type":"progress","data":{"progress":0.5}}\n')
    assert out.events == [Progress({"progress": 0.5})]
    framer.feed(b'{"type":"done","data":{"result":{}}}')
    assert framer.finish().events == [Done({"result": {}})]


def test_events_are_typed_once_and_keep_what_the_job_wrote() -> None:
    framer = EventFramer()
    out = framer.feed(
        b'{"type":"progress","data":{"progress":1.5,"step":3,"message":"m"}}\n'
        b'{"type":"stage","data":{"stage":7}}\n'
        b'{"type":"failed","data":{"error":"boom"}}\n'
        b'{"type":"done","data":{"result":[1]}}\n'
    )
    progress, stage, failed, done = out.events
    assert isinstance(progress, Progress) and progress.fraction == 1.0 and progress.message == "m"
    assert progress.data == {"progress": 1.5, "step": 3, "message": "m"}  # stored as written
    assert isinstance(stage, Stage) and stage.stage is None
    assert isinstance(failed, Failed) and failed.error == "boom"
    assert isinstance(done, Done) and done.result == {}
    assert msgspec.json.decode(msgspec.json.encode(progress)) == {
        "type": "progress", "data": {"progress": 1.5, "step": 3, "message": "m"}}


async def test_store_reopens_cleanly(tmp_path: Path) -> None:
    async with open_store(tmp_path / "db.sqlite") as store:
        assert await store.db.user_version() == len(JOBS_MIGRATIONS)
    async with open_store(tmp_path / "db.sqlite") as store:
        assert await store.db.integrity_ok()


async def test_prune_once_at_an_injected_time(tmp_path: Path) -> None:
    async with running_lab(tmp_path) as lab:
        from jobs.params import SleepParams

        job, _ = await lab.runner.submit("sleep", SleepParams(steps=1, step_seconds=0.0))
        done = await wait_finished(lab.store, job.id)
        assert done.status == "succeeded" and done.log_path and done.finished_at is not None
        retention = lab.runner.settings.retention_s
        # Within the retention nothing goes; past it the job and its log do, without sleeping.
        assert await lab.runner.prune_once(now=done.finished_at + retention - 1) == []
        assert Path(done.log_path).exists()
        assert await lab.runner.prune_once(now=done.finished_at + retention + 1) == [job.id]
        assert not Path(done.log_path).exists()
