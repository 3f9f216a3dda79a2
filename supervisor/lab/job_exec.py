"""One job's process: spawned in its own session, fed its params on stdin,
its NDJSON events decoded and stored, killed by group when it is done.

:class:`JobExecution` knows nothing of scheduling or final statuses: the
runner decides those from the exit code and the events stored here.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

import psutil

import jobs
from jobs.events import Done, Failed, JobEvent
from supervisor.lab.active import ActiveJob, RunnerSettings, StopReason
from supervisor.lab.job_command import JobCommand, job_command
from supervisor.lab.job_process import EventFramer, child_environ, kill_group
from supervisor.lab.job_schema import Job
from supervisor.lab.lease import GpuLease
from supervisor.lab.store import JobStore

log = logging.getLogger(__name__)


class SpawnFailed(Exception):
    """The job process could not be started (the OSError's text)."""


class JobExecution:
    """Runs one job process at a time per call; shared by all of a runner's jobs."""

    def __init__(
        self,
        store: JobStore,
        lease: GpuLease,
        settings: RunnerSettings,
        request_stop: Callable[[ActiveJob, StopReason], None],
        signal_stop: Callable[[ActiveJob, bool], None],
    ) -> None:
        self.store = store
        self.lease = lease
        self.settings = settings
        # The runner's: a stop when heartbeats stop, and the signal for a
        # stop that came while the job was being spawned.
        self._request_stop = request_stop
        self._signal_stop = signal_stop

    def _command(self, job: Job, devices: list[str]) -> tuple[JobCommand, dict[str, str]]:
        """The job's command (job_command.py) and its full environment here."""
        # On a GPU machine a job sees exactly the devices it holds (CUDA and ROCm).
        pinned = self.lease.gpu_indices(devices) if self.lease.gpu_indices(self.lease.devices) else None
        cmd = job_command(job, self.settings, pinned)
        env = {**child_environ(os.environ), **cmd.env}
        root = str(Path(jobs.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        return cmd, env

    async def run(self, active: ActiveJob, devices: list[str], log_path: Path) -> int:
        """Spawn the job, feed it, store its events; its exit code once its
        whole group is gone. :class:`SpawnFailed` when it cannot start."""
        cmd, env = self._command(active.job, devices)
        try:
            with log_path.open("ab") as log_file:
                proc = await asyncio.create_subprocess_exec(
                    self.settings.python, *cmd.argv,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=log_file,
                    start_new_session=True,
                    env=env,
                )
        except OSError as exc:
            raise SpawnFailed(str(exc)) from exc
        active.pgid = proc.pid  # a new session: the leader's pid is the group id
        try:
            rc = await self._supervise(active, proc, log_path, cmd.stdin_line)
        finally:
            # Whatever happened, nothing of the job may outlive this point.
            await kill_group(proc.pid)
            if proc.returncode is None:
                await proc.wait()
        return rc

    async def _supervise(
        self, active: ActiveJob, proc: asyncio.subprocess.Process, log_path: Path, line: bytes
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
            self._signal_stop(active, active.stop_reason == "heartbeat")
        assert proc.stdin is not None and proc.stdout is not None
        # The pipe stays open: its EOF tells the job the parent is gone.
        with suppress(BrokenPipeError, ConnectionResetError):
            proc.stdin.write(line)
            await proc.stdin.drain()
        await self._pump(active, proc.stdout)
        rc = await proc.wait()
        if proc.stdin is not None:
            proc.stdin.close()
        return rc

    async def _pump(self, active: ActiveJob, stdout: asyncio.StreamReader) -> None:
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

    async def _store_events(self, active: ActiveJob, events: list[JobEvent]) -> None:
        for event in events:
            if isinstance(event, Done | Failed) and active.terminal is None:
                active.terminal = event
        await self.store.append_events(active.job.id, events)
