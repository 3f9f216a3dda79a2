"""The job runner: one subprocess per running job, under the GPU lease.

The runner claims queued jobs while it has free slots, waits for each job's
devices on the lease, spawns ``python -m jobs <kind>`` in a new session, feeds
it its params on stdin, stores its NDJSON events and decides its final status
once its whole process group is gone; only then is the lease released.

Stopping a job is always by signal to its group: SIGTERM (the job stops at
its next step boundary), then SIGKILL after the kind's grace. Resumable kinds
(``KindSpec.resumable``) get SIGUSR1 instead when the stop should keep their
work: cancel with save, and shutdown; they write a checkpoint, then stop.
Resuming re-queues the same job (same id, events and output dir) as a new
attempt. The runner owns every task it starts: the scheduler, the pruner and
one task per job.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import sys
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec
import psutil

import jobs
from jobs.context import JobContext
from jobs.params import JobParams, KindSpec, Roots, kind_spec, params_dict
from supervisor.errors import ApiError, BadRequest, StorageFull
from supervisor.lab.job_process import (
    EventFramer,
    describe_exit,
    job_environ,
    kill_group,
    log_tail,
    signal_group,
)
from supervisor.lab.lease import GpuLease, cuda_visible_devices
from supervisor.lab.store import DEFAULT_RETENTION_S, Job, JobStore, Recovery, Status

log = logging.getLogger(__name__)

StopReason = Literal["cancel", "shutdown", "heartbeat"]


@dataclass(frozen=True)
class RunnerSettings:
    state_dir: Path
    roots: Roots
    python: str = sys.executable
    # None: one job per lease device.
    max_concurrent: int | None = None
    # Per-kind SIGTERM -> SIGKILL grace; kinds not listed use their KindSpec's.
    grace_s: Mapping[str, float] = field(default_factory=dict)
    heartbeat_timeout_s: float = 120.0
    keepalive_s: float = 5.0
    # At shutdown: how long jobs get to checkpoint and stop before SIGKILL.
    stop_timeout_s: float = 10.0
    max_line_bytes: int = 1 << 20
    log_tail_bytes: int = 2000
    retention_s: float = DEFAULT_RETENTION_S
    prune_interval_s: float = 3600.0
    # Extra environment for job processes (e.g. HF_TOKEN, HF_HUB_CACHE).
    extra_env: Mapping[str, str] = field(default_factory=dict)

    @property
    def logs_dir(self) -> Path:
        return self.state_dir / "jobs"


@dataclass(eq=False)
class _Active:
    job: Job
    spec: KindSpec
    stop_reason: StopReason | None = None
    stop_requested: asyncio.Event = field(default_factory=asyncio.Event)
    pgid: int | None = None
    # Stop with SIGUSR1 (save a checkpoint first) rather than SIGTERM.
    save: bool = False
    terminal: tuple[str, dict[str, Any]] | None = None
    grace: float | None = None
    task: asyncio.Task[None] | None = None
    killer: asyncio.Task[None] | None = None


@dataclass(frozen=True)
class _Outcome:
    status: Status
    result: dict[str, Any] | None
    error: str | None
    exit_code: int | None


class JobRunner:
    """Runs queued jobs; ``start()`` / ``stop()`` own all of its tasks."""

    def __init__(self, store: JobStore, lease: GpuLease, settings: RunnerSettings) -> None:
        self.store = store
        self.lease = lease
        self.settings = settings
        self.max_concurrent = settings.max_concurrent or len(lease.devices)
        self._active: dict[str, _Active] = {}
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        # Final states waiting for disk space (see _record_later).
        self._late_records: set[asyncio.Task[None]] = set()
        self._stopping = False

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> Recovery:
        """Recover from the last run, then start claiming jobs."""
        self.settings.logs_dir.mkdir(parents=True, exist_ok=True)
        report = await self.store.recover_at_boot()
        if report.interrupted:
            log.warning("jobs interrupted by the last shutdown: %s", ", ".join(report.interrupted))
        self._tasks = [
            asyncio.create_task(self._schedule(), name="job-scheduler"),
            asyncio.create_task(self._prune_loop(), name="job-pruner"),
        ]
        self.wake()
        return report

    async def stop(self) -> None:
        """Ask running jobs to stop, SIGKILL what is left after the bound."""
        self._stopping = True
        for task in [*self._tasks, *self._late_records]:
            task.cancel()
        for task in [*self._tasks, *self._late_records]:
            with suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        active = list(self._active.values())
        for a in active:
            # Resumable jobs checkpoint on the way out, so resume loses little.
            self._request_stop(a, "shutdown", grace=self.settings.stop_timeout_s, save=a.spec.resumable)
        pending = [a.task for a in active if a.task is not None]
        if pending:
            _, late = await asyncio.wait(pending, timeout=self.settings.stop_timeout_s + 5.0)
            for task in late:
                # The job tasks kill their groups in ``finally``.
                task.cancel()
            if late:
                await asyncio.wait(late, timeout=10.0)

    def wake(self) -> None:
        self._wake.set()

    # ------------------------------------------------------------ commands

    async def submit(
        self, kind: str, params: JobParams, priority: int = 0, owner: str | None = None
    ) -> tuple[Job, bool]:
        job, created = await self.store.submit(kind, params_dict(params), priority, owner)
        if created:
            self.wake()
        return job, created

    async def cancel(self, job_id: str, save: bool = False) -> Job:
        """Queued: cancelled now. Running: SIGTERM (SIGUSR1 with ``save``),
        SIGKILL after the grace; the job becomes ``cancelled`` once its
        process group is gone."""
        if save:
            job = await self.store.get(job_id)
            if not kind_spec(job.kind).resumable:
                raise BadRequest(f"{job.kind} jobs cannot save on cancel", param="save")
        job = await self.store.request_cancel(job_id)
        active = self._active.get(job_id)
        if job.status == "running" and active is not None:
            self._request_stop(active, "cancel", save=save)
        return job

    async def resume(self, job_id: str) -> Job:
        """Queue a stopped job of a resumable kind again (a new attempt)."""
        job = await self.store.get(job_id)
        if not kind_spec(job.kind).resumable:
            raise BadRequest(f"{job.kind} jobs cannot be resumed", param="id")
        job = await self.store.reopen(job_id)
        self.wake()
        return job

    def running(self) -> list[str]:
        return list(self._active)

    # ------------------------------------------------------------ scheduling

    async def _schedule(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._fill_slots()
            except (OSError, ApiError, msgspec.ValidationError) as exc:
                log.error("job scheduler: %s", exc)
                await asyncio.sleep(1.0)
                self.wake()

    async def _fill_slots(self) -> None:
        while not self._stopping and len(self._active) < self.max_concurrent:
            job = await self.store.claim_next()
            if job is None:
                return
            try:
                spec = kind_spec(job.kind)
            except ApiError:
                await self.store.finish(job.id, "failed", error=f"unknown job kind {job.kind!r}")
                continue
            active = _Active(job, spec)
            self._active[job.id] = active
            active.task = asyncio.create_task(self._run(active), name=f"job-{job.id}")
            active.task.add_done_callback(functools.partial(self._finished, active))

    def _finished(self, active: _Active, _task: asyncio.Task[None]) -> None:
        task = active.task
        if task is not None and not task.cancelled() and task.exception() is not None:
            log.error("job %s: runner task failed", active.job.id, exc_info=task.exception())
        self._active.pop(active.job.id, None)
        if active.killer is not None:
            active.killer.cancel()
        self.wake()

    async def _prune_loop(self) -> None:
        while True:
            try:
                for job in await self.store.prune(self.settings.retention_s):
                    if job.log_path:
                        Path(job.log_path).unlink(missing_ok=True)
            except (OSError, ApiError) as exc:
                log.error("pruning old jobs: %s", exc)
            await asyncio.sleep(self.settings.prune_interval_s)

    def hurry(self) -> None:
        """A second shutdown signal: kill the jobs still stopping, now."""
        for a in self._active.values():
            if a.pgid is None:
                continue
            log.warning("job %s: killed without waiting for its grace", a.job.id)
            if a.killer is not None:
                a.killer.cancel()
            a.killer = asyncio.create_task(self._kill_after(a.pgid, 0.0))

    # ------------------------------------------------------------ one job

    def _grace(self, kind: str) -> float:
        return self.settings.grace_s.get(kind, kind_spec(kind).grace_s)

    def _request_stop(
        self, active: _Active, reason: StopReason, grace: float | None = None, save: bool = False
    ) -> None:
        """Record why the job must stop; signal it if it has a process yet."""
        if active.stop_reason is None:
            active.stop_reason = reason
        if save and not active.save and active.killer is not None and active.pgid is not None:
            # Already asked to stop without saving: ask again, with saving.
            signal_group(active.pgid, signal.SIGUSR1)
        active.save = active.save or save
        if grace is not None:
            active.grace = min(active.grace, grace) if active.grace is not None else grace
        active.stop_requested.set()
        self._signal_stop(active, force=reason == "heartbeat")

    def _signal_stop(self, active: _Active, force: bool = False) -> None:
        if active.pgid is None:
            return
        if force:
            signal_group(active.pgid, signal.SIGKILL)
            return
        if active.killer is not None:
            return
        signal_group(active.pgid, signal.SIGUSR1 if active.save else signal.SIGTERM)
        grace = self._grace(active.job.kind)
        delay = grace if active.grace is None else min(grace, active.grace)
        active.killer = asyncio.create_task(self._kill_after(active.pgid, delay))

    @staticmethod
    async def _kill_after(pgid: int, delay: float) -> None:
        await asyncio.sleep(delay)
        signal_group(pgid, signal.SIGKILL)

    async def _run(self, active: _Active) -> None:
        try:
            await self._run_job(active)
        except StorageFull as exc:
            # An expected event: the job was killed (its progress could not be
            # kept); the outcome is recorded once the disk has room again.
            log.error("job %s: %s; the job was stopped", active.job.id, exc.message)
            await self._finish(active, "failed", error=f"stopped: {exc.message}")
        except Exception as exc:
            log.exception("job %s: runner error", active.job.id)
            await self._finish(active, "failed", error=f"runner error: {type(exc).__name__}: {exc}")

    async def _run_job(self, active: _Active) -> None:
        job = active.job
        try:
            params = msgspec.convert(job.params, active.spec.params)
        except msgspec.ValidationError as exc:
            await self._finish(active, "failed", error=f"stored params no longer valid: {exc}")
            return
        devices = params.devices(self.lease.devices)
        if devices and not await self._acquire(active, devices):
            return
        try:
            if active.stop_reason is not None:
                await self._end_unstarted(active)
            else:
                await self._execute(active, devices)
        finally:
            if devices:
                self.lease.release_job(job.id)

    async def _end_unstarted(self, active: _Active, error: BaseException | None = None) -> None:
        """The job was stopped (or failed to get its device) before it ran."""
        if active.stop_reason == "shutdown":
            await self.store.requeue(active.job.id)
        elif active.stop_reason == "cancel":
            await self._finish(active, "cancelled", error="cancelled before it started")
        else:
            await self._finish(active, "failed", error=f"could not get the device: {error}")

    async def _acquire(self, active: _Active, devices: list[str]) -> bool:
        """Wait for the lease unless stopped first; False when the job ended."""
        job = active.job
        await self.store.set_stage(job.id, "waiting for device", f"waiting for {', '.join(devices)}")
        acquire = asyncio.create_task(self.lease.acquire_job(job.id, job.kind, devices, job.priority))
        stopped = asyncio.create_task(active.stop_requested.wait())
        try:
            await asyncio.wait({acquire, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not acquire.done():
                acquire.cancel()
            with suppress(asyncio.CancelledError):
                await acquire
        error = None if acquire.cancelled() else acquire.exception()
        if active.stop_reason is None and error is None:
            return True
        if not acquire.cancelled() and error is None:
            self.lease.release_job(job.id)
        await self._end_unstarted(active, error)
        return False

    def _env(self, kind: str, devices: list[str]) -> dict[str, str]:
        # An allowlist of ours; the HF token only for the kinds that download.
        env = job_environ(kind, os.environ, self.settings.extra_env)
        root = str(Path(jobs.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        if any(self.lease.device(d).index is not None for d in self.lease.devices):
            # On a GPU machine a job sees exactly the devices it holds.
            env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices([self.lease.device(d) for d in devices])
        return env

    def _context(self, job: Job) -> JobContext:
        r = self.settings.roots
        return JobContext(
            job_id=job.id,
            models_dir=str(r.models),
            datasets_dir=str(r.datasets),
            outputs_dir=str(r.outputs),
            keepalive_s=self.settings.keepalive_s,
            attempt=job.attempt,
        )

    async def _execute(self, active: _Active, devices: list[str]) -> None:
        job = active.job
        log_path = self.settings.logs_dir / f"{job.id}.log"
        try:
            with log_path.open("ab") as log_file:
                proc = await asyncio.create_subprocess_exec(
                    self.settings.python, "-m", "jobs", job.kind,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=log_file,
                    start_new_session=True,
                    env=self._env(job.kind, devices),
                )
        except OSError as exc:
            await self._finish(active, "failed", error=f"could not start the job process: {exc}")
            return
        active.pgid = proc.pid  # a new session: the leader's pid is the group id
        try:
            rc = await self._supervise(active, proc, log_path)
        finally:
            # Whatever happened, nothing of the job may outlive this point.
            await kill_group(proc.pid)
            if proc.returncode is None:
                await proc.wait()
        await self._conclude(active, rc, log_path)

    async def _supervise(
        self, active: _Active, proc: asyncio.subprocess.Process, log_path: Path
    ) -> int:
        job = active.job
        try:
            create_time: float | None = psutil.Process(proc.pid).create_time()
        except psutil.NoSuchProcess:
            create_time = None
        await self.store.mark_running(
            job.id, pid=proc.pid, pgid=proc.pid, create_time=create_time, log_path=str(log_path)
        )
        if active.stop_reason is not None:
            # Stopped while it was being spawned.
            self._signal_stop(active, force=active.stop_reason == "heartbeat")
        assert proc.stdin is not None and proc.stdout is not None
        line = msgspec.json.encode({"params": job.params, "context": self._context(job)})
        # The pipe stays open: its EOF tells the job the parent is gone.
        with suppress(BrokenPipeError, ConnectionResetError):
            proc.stdin.write(line + b"\n")
            await proc.stdin.drain()
        await self._pump(active, proc.stdout)
        rc = await proc.wait()
        if proc.stdin is not None:
            proc.stdin.close()
        return rc

    async def _pump(self, active: _Active, stdout: asyncio.StreamReader) -> None:
        """Store events until EOF; kill the group when heartbeats stop."""
        loop = asyncio.get_running_loop()
        framer = EventFramer(self.settings.max_line_bytes)
        timeout = self.settings.heartbeat_timeout_s
        last_touch = loop.time()
        while True:
            try:
                chunk = await asyncio.wait_for(stdout.read(1 << 16), timeout)
            except TimeoutError:
                log.warning("job %s sent nothing for %.0f s: killing it", active.job.id, timeout)
                self._request_stop(active, "heartbeat")
                timeout = self.settings.stop_timeout_s + 60.0
                continue
            framed = framer.feed(chunk) if chunk else framer.finish()
            if framed.events:
                await self._store_events(active, framed.events)
                last_touch = loop.time()
            elif framed.keepalives and loop.time() - last_touch > self.settings.keepalive_s:
                await self.store.touch(active.job.id)
                last_touch = loop.time()
            if not chunk:
                return

    async def _store_events(self, active: _Active, events: list[tuple[str, dict[str, Any]]]) -> None:
        for type_, data in events:
            if type_ in ("done", "failed") and active.terminal is None:
                active.terminal = (type_, data)
        await self.store.append_events(active.job.id, events)

    async def _conclude(self, active: _Active, rc: int, log_path: Path) -> None:
        how = describe_exit(rc)
        terminal = active.terminal
        if terminal is not None and terminal[0] == "done":
            result = terminal[1].get("result")
            await self._finish(
                active, "succeeded", result=result if isinstance(result, dict) else {}, exit_code=rc
            )
        elif active.stop_reason == "cancel":
            await self._finish(active, "cancelled", error="cancelled on request", exit_code=rc)
        elif active.stop_reason == "shutdown":
            await self._finish(active, "interrupted", error="supervisor shut down", exit_code=rc)
        elif active.stop_reason == "heartbeat":
            error = f"no events for {self.settings.heartbeat_timeout_s:.0f} s: killed ({how})"
            await self._finish(active, "failed", error=error, exit_code=rc)
        elif terminal is not None:
            await self._finish(active, "failed", error=str(terminal[1].get("error")), exit_code=rc)
        else:
            tail = log_tail(log_path, self.settings.log_tail_bytes)
            error = f"job process {how} without finishing"
            await self._finish(
                active, "failed", error=error + (f"; log tail:\n{tail}" if tail else ""), exit_code=rc
            )

    async def _finish(
        self,
        active: _Active,
        status: Status,
        *,
        result: dict[str, Any] | None = None,
        error: str | None = None,
        exit_code: int | None = None,
    ) -> None:
        outcome = _Outcome(status, result, error, exit_code)
        try:
            await self._record(active.job.id, outcome)
        except StorageFull as exc:
            log.error("job %s ended (%s) but the disk is full: %s; retrying until it has room",
                      active.job.id, status, exc.message)
            task = asyncio.create_task(self._record_later(active.job.id, outcome),
                                       name=f"job-{active.job.id}-record")
            self._late_records.add(task)
            task.add_done_callback(self._late_records.discard)

    async def _record(self, job_id: str, o: _Outcome) -> None:
        try:
            await self.store.finish(job_id, o.status, result=o.result, error=o.error, exit_code=o.exit_code)
        except StorageFull:
            raise
        except ApiError as exc:
            # Already finished elsewhere (say, cancelled while still queued).
            log.info("job %s: %s", job_id, exc.message)

    async def _record_later(self, job_id: str, outcome: _Outcome) -> None:
        """Retry a final state the full disk refused. Cancelled at shutdown:
        boot recovery then marks the job ``interrupted``."""
        delay = 0.5
        while True:
            await asyncio.sleep(delay)
            try:
                await self._record(job_id, outcome)
            except StorageFull:
                delay = min(delay * 2, 10.0)
                continue
            log.info("job %s: its final state (%s) is saved now", job_id, outcome.status)
            return

