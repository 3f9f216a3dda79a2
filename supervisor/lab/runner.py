"""The job runner: one subprocess per running job, under the GPU lease.

The runner picks queued jobs while it has free slots and waits for each job's
devices on the lease; the job stays ``queued`` until it holds them, then
becomes ``running``. The runner spawns ``python -m jobs <kind>`` in a new session, feeds
it its params on stdin, stores its NDJSON events and decides its final status
once its whole process group is gone; only then is the lease released.

Stopping a job is always by signal to its group: SIGTERM (the job stops at
its next step boundary), then SIGKILL after the kind's grace. Resumable kinds
(``KindSpec.resumable``) get SIGUSR1 instead when the stop should keep their
work: cancel with save, and shutdown; they write a checkpoint, then stop.
Resuming re-queues the same job (same id, events and output dir) as a new
attempt. The runner owns every task it starts: the scheduler, the pruner and
one task per job.

With a cluster (``nodes``), a job whose devices are a cluster node's, or
one of a kind that books no device naming a node (``node``), runs on that
node through its agent (lab/node_exec.py), signalled there
(``ActiveJob.send``); a node lost mid-job makes it ``interrupted``. A job
asking for a count that no single machine gives first goes whole to one
node that has it (:meth:`GpuLease.on_one_machine`). Without ``nodes``,
nothing of this runs.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

import msgspec

from jobs.errors import ParamError
from jobs.kinds import KindSpec, kind_spec, params_dict, stored_params
from jobs.params import JobParams
from supervisor.errors import (
    ApiError,
    BadRequest,
    StorageFull,
    Unavailable,
    param_error,
)
from supervisor.lab.active import ActiveJob, RunnerSettings, StopReason
from supervisor.lab.job_exec import JobExecution, SpawnFailed
from supervisor.lab.job_process import (
    signal_group,
)
from supervisor.lab.lease import GpuLease
from supervisor.lab.leftovers import remove_job_temps
from supervisor.lab.node_exec import NodeJobExecution, NodeSpawnFailed, job_node
from supervisor.lab.node_files import NodeFiles
from supervisor.lab.node_jobs import JobNodes, NodeJobLost
from supervisor.lab.node_models import NodeModels
from supervisor.lab.outcome import Outcome, outcome_of, record, record_later
from supervisor.lab.store import (
    WAITING_STAGE,
    Job,
    JobStore,
    Recovery,
    Status,
)
from supervisor.models.entry import ModelEntry

log = logging.getLogger(__name__)

__all__ = ["JobRunner", "RunnerSettings"]

def _stored_spec(kind: str) -> KindSpec:
    try:
        return kind_spec(kind)
    except ParamError as exc:
        raise param_error(exc) from exc


def _send(active: ActiveJob, sig: int) -> None:
    """Signal the job's group: through its node's agent, or here."""
    if active.send is not None:
        active.send(sig)
    elif active.pgid is not None:
        signal_group(active.pgid, sig)


class JobRunner:
    """Runs queued jobs; ``start()`` / ``stop()`` own all of its tasks."""

    def __init__(self, store: JobStore, lease: GpuLease, settings: RunnerSettings,
                 nodes: JobNodes | None = None,
                 on_node_models: Callable[[list[ModelEntry]], None] | None = None) -> None:
        self.store = store
        self.lease = lease
        self.settings = settings
        self.max_concurrent = settings.max_concurrent or len(lease.devices)
        self._active: dict[str, ActiveJob] = {}
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        # Final states waiting for disk space (see lab/outcome.py).
        self._late_records: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._stopped: asyncio.Future[None] | None = None
        self._exec = JobExecution(store, lease, settings, self._request_stop, self._signal_stop)
        # With a cluster: jobs whose devices are a node's run there (lab/node_exec.py).
        self._node_exec: NodeJobExecution | None = None
        self._nodes = nodes
        # With a cluster: the models held on nodes' own disks, checked and removed (lab/node_models.py).
        self.node_models: NodeModels | None = None
        if nodes is not None:
            # Downloads into nodes' own caches are recorded and listed (lab/node_files.py).
            files = NodeFiles(store.db)
            self.node_models = NodeModels(files, nodes, on_node_models)
            self._node_exec = NodeJobExecution(nodes, store, lease, settings, self._request_stop,
                                               self._signal_stop, files, self.node_models.relist)
            lease.jobs_on_nodes = True

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> Recovery:
        """Recover from the last run, then start claiming jobs."""
        self.settings.logs_dir.mkdir(parents=True, exist_ok=True)
        report = await self.store.recover_at_boot()
        if report.interrupted:
            log.warning("jobs interrupted by the last shutdown: %s", ", ".join(report.interrupted))
        if self.node_models is not None:
            # The models nodes hold on their own disks, as recorded by earlier runs.
            await self.node_models.relist()
        # No job runs yet: every job temp file is a leftover of a killed one.
        await asyncio.to_thread(remove_job_temps, self.settings.roots.all())
        self._tasks = [
            asyncio.create_task(self._schedule(), name="job-scheduler"),
            asyncio.create_task(self._prune_loop(), name="job-pruner"),
        ]
        self.wake()
        return report

    async def stop(self) -> None:
        """Ask running jobs to stop, SIGKILL what is left after the bound.

        Runs once: the shutdown drain and the runner's cleanup context both
        call it, and the later call waits for the first one's end.
        """
        if self._stopped is None:
            self._stopped = asyncio.ensure_future(self._stop())
        await asyncio.shield(self._stopped)

    async def _stop(self) -> None:
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
        node = params.on_node()
        if node is not None:
            await self.check_node(node)
        job, created = await self.store.submit(kind, params_dict(params), priority, owner)
        if created:
            self.wake()
        return job, created

    async def alive_nodes(self, purpose: str) -> list[str] | None:
        """The cluster's alive nodes, which a job may name; None without a
        cluster. A 503 when the cluster does not answer (``purpose`` says
        what they were listed for)."""
        if self._nodes is None:
            return None
        try:
            return sorted(await self._nodes.node_names())
        except OSError as exc:  # ClusterError: the cluster did not answer
            raise Unavailable(f"cannot list the cluster's nodes {purpose}: {exc}", retry_after=5) from exc

    async def check_node(self, node: str, param: str = "params.node") -> None:
        """A job's ``node`` must be an alive node of the cluster: a 400
        naming it (and ``param``) now, not a failed job later."""
        alive = await self.alive_nodes(f"to check node {node!r}")
        if alive is None:
            raise BadRequest(f"node {node!r}: no cluster is configured (ray_address is unset), so jobs "
                             "run on this machine only; leave node out", param=param)
        if node not in alive:
            raise BadRequest(f"node {node!r} is not an alive node of the cluster (alive: "
                             f"{', '.join(alive) or 'none'})", param=param,
                             code="node_not_found")

    async def cancel(self, job_id: str, save: bool = False) -> Job:
        """Queued: cancelled now. Running: SIGTERM (SIGUSR1 with ``save``),
        SIGKILL after the grace; the job becomes ``cancelled`` once its
        process group is gone."""
        if save:
            job = await self.store.get(job_id)
            if not _stored_spec(job.kind).resumable:
                raise BadRequest(f"{job.kind} jobs cannot save on cancel", param="save")
        job = await self.store.request_cancel(job_id)
        active = self._active.get(job_id)
        if active is not None:
            self._request_stop(active, "cancel", save=save)
            if job.finished and active.task is not None:
                # It was queued, waiting for its devices: answer once it has
                # left the lease's queue.
                await asyncio.wait({active.task}, timeout=5.0)
        return job

    async def resume(self, job_id: str) -> Job:
        """Queue a stopped job of a resumable kind again (a new attempt)."""
        job = await self.store.get(job_id)
        if not _stored_spec(job.kind).resumable:
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
            job = await self.store.next_queued(exclude=self._active)
            if job is None:
                return
            try:
                spec = kind_spec(job.kind)
            except ParamError as exc:
                # Stored before this kind was removed (or a test-only kind now off).
                await self.store.finish(job.id, "failed", error=str(exc))
                continue
            active = ActiveJob(job, spec)
            self._active[job.id] = active
            active.task = asyncio.create_task(self._run(active), name=f"job-{job.id}")
            active.task.add_done_callback(functools.partial(self._finished, active))

    def _finished(self, active: ActiveJob, _task: asyncio.Task[None]) -> None:
        task = active.task
        if task is not None and not task.cancelled() and task.exception() is not None:
            log.error("job %s: runner task failed", active.job.id, exc_info=task.exception())
        self._active.pop(active.job.id, None)
        if active.killer is not None:
            active.killer.cancel()
        self.wake()

    async def prune_once(self, now: float | None = None) -> list[str]:
        """Delete finished jobs past the retention at ``now`` (default: the
        store's clock) with their log files; the ids deleted."""
        pruned = await self.store.prune(self.settings.retention_s, now)
        for job in pruned:
            if job.log_path:
                Path(job.log_path).unlink(missing_ok=True)
        if pruned:
            await asyncio.to_thread(remove_job_temps, self.settings.roots.all(), {j.id for j in pruned})
        return [job.id for job in pruned]

    async def _prune_loop(self) -> None:
        while True:
            try:
                await self.prune_once()
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
            a.killer = asyncio.create_task(self._kill_after(a, 0.0))

    # ------------------------------------------------------------ one job

    def _grace(self, kind: str) -> float:
        return self.settings.grace_s.get(kind, kind_spec(kind).grace_s)

    def _request_stop(
        self, active: ActiveJob, reason: StopReason, grace: float | None = None, save: bool = False
    ) -> None:
        """Record why the job must stop; signal it if it has a process yet."""
        if active.stop_reason is None:
            active.stop_reason = reason
        if save and not active.save and active.killer is not None and active.pgid is not None:
            # Already asked to stop without saving: ask again, with saving.
            _send(active, signal.SIGUSR1)
        active.save = active.save or save
        if grace is not None:
            active.grace = min(active.grace, grace) if active.grace is not None else grace
        active.stop_requested.set()
        self._signal_stop(active, force=reason == "heartbeat")

    def _signal_stop(self, active: ActiveJob, force: bool = False) -> None:
        if active.pgid is None:
            return
        if force:
            _send(active, signal.SIGKILL)
            return
        if active.killer is not None:
            return
        _send(active, signal.SIGUSR1 if active.save else signal.SIGTERM)
        grace = self._grace(active.job.kind)
        delay = grace if active.grace is None else min(grace, active.grace)
        active.killer = asyncio.create_task(self._kill_after(active, delay))

    @staticmethod
    async def _kill_after(active: ActiveJob, delay: float) -> None:
        await asyncio.sleep(delay)
        _send(active, signal.SIGKILL)

    async def _run(self, active: ActiveJob) -> None:
        try:
            await self._run_job(active)
        except NodeJobLost as exc:
            # Its process ended with its node's agent; like a restart, it is not re-run.
            log.warning("job %s: %s", active.job.id, exc)
            await self._finish(active, "interrupted", error=str(exc))
        except StorageFull as exc:
            # An expected event: the job was killed (its progress could not be
            # kept); the outcome is recorded once the disk has room again.
            log.error("job %s: %s; the job was stopped", active.job.id, exc.message)
            await self._finish(active, "failed", error=f"stopped: {exc.message}")
        except Exception as exc:
            log.exception("job %s: runner error", active.job.id)
            await self._finish(active, "failed", error=f"runner error: {type(exc).__name__}: {exc}")

    async def _run_job(self, active: ActiveJob) -> None:
        job = active.job
        try:
            params = stored_params(active.spec, job.params)
        except msgspec.ValidationError as exc:
            await self._finish(active, "failed", error=f"stored params no longer valid: {exc}")
            return
        try:
            # A count of devices takes the least used first; named ones are checked.
            devices = params.devices(self.lease.preferred())
        except ParamError as exc:
            await self._finish(active, "failed", error=f"could not get the device: {exc}")
            return
        if self._node_exec is not None and getattr(params, "gpu_ids", None) is None:
            try:
                # A count the first machines could not give on one: a node that has them.
                devices = self.lease.on_one_machine(devices)
            except ValueError as exc:
                await self._finish(active, "failed", error=f"could not get the device: {exc}")
                return
        try:
            node = self._job_machine(params, devices)
        except ValueError as exc:
            await self._finish(active, "failed", error=f"could not place the job: {exc}")
            return
        if devices and not await self._acquire(active, devices):
            return
        try:
            if active.stop_reason is not None:
                return  # stopped as it got the lease: still queued
            started = await self.store.start(job.id, node or None)
            if started is None:
                return  # cancelled while it waited
            active.job = started
            await self._execute(active, node, devices)
        finally:
            if devices:
                self.lease.release_job(job.id)

    def _job_machine(self, params: JobParams, devices: list[str]) -> str:
        """The node the job runs on ("" for this machine): the one it names,
        else the one its devices are on. ValueError when they disagree."""
        on = job_node(devices) if self._node_exec is not None else ""
        node = params.on_node() or on
        if node and self._node_exec is None:
            raise ValueError(f"it names node {node}, and no cluster is configured")
        if devices and on != node:
            raise ValueError(f"it names node {node}, and its devices are on {on or 'this machine'}")
        return node

    async def _end_unstarted(self, active: ActiveJob, error: BaseException | None) -> None:
        """The job was stopped (or failed to get its device) while queued.

        Cancelled: the store has cancelled it already. Shutdown: it stays
        queued and runs after the restart.
        """
        if active.stop_reason is None:
            await self._finish(active, "failed", error=f"could not get the device: {error}")

    async def _acquire(self, active: ActiveJob, devices: list[str]) -> bool:
        """Wait for the lease unless stopped first; False when the job ended."""
        job = active.job
        await self.store.set_stage(job.id, WAITING_STAGE, f"waiting for {', '.join(devices)}")
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

    async def _execute(self, active: ActiveJob, node: str, devices: list[str]) -> None:
        log_path = self.settings.logs_dir / f"{active.job.id}.log"
        try:
            if self._node_exec is not None and node:
                rc = await self._node_exec.run(active, node, devices, log_path)
            else:
                rc = await self._exec.run(active, devices, log_path)
        except (SpawnFailed, NodeSpawnFailed) as exc:
            await self._finish(active, "failed", error=f"could not start the job process: {exc}")
            return
        await self._conclude(active, rc, log_path)

    async def _conclude(self, active: ActiveJob, rc: int, log_path: Path) -> None:
        await self._record_outcome(active, outcome_of(active, rc, log_path, self.settings))

    async def _finish(
        self,
        active: ActiveJob,
        status: Status,
        *,
        result: dict[str, Any] | None = None,
        error: str | None = None,
        exit_code: int | None = None,
    ) -> None:
        await self._record_outcome(active, Outcome(status, result, error, exit_code))

    async def _record_outcome(self, active: ActiveJob, outcome: Outcome) -> None:
        try:
            await record(self.store, active.job.id, outcome)
        except StorageFull as exc:
            log.error("job %s ended (%s) but the disk is full: %s; retrying until it has room",
                      active.job.id, outcome.status, exc.message)
            task = asyncio.create_task(record_later(self.store, active.job.id, outcome),
                                       name=f"job-{active.job.id}-record")
            self._late_records.add(task)
            task.add_done_callback(self._late_records.discard)
