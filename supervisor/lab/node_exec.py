"""One job's process on a cluster node: the node-side twin of job_exec.py.

A job whose devices are a node's (``node-b/cuda:0``), or that names a node
(the ``node`` param of a kind that books no device: quantize, dataset,
download), runs on that node: its agent starts ``python -m jobs <kind>``
there (supervisor/workers/node_agent.py) with the command job_command.py
builds for a local job too (the same params line on stdin, the parent's
extra job settings, the Hugging Face token for the kinds that download
only) over the node's allowlisted environment, and the job's GPUs pinned
by their index on that node (none for a job that books none). The
job's paths (models, datasets, outputs) are the parent's: the lab shares
those directories with its nodes (NFS and the like, docs/cluster.md).

Its stdout comes back by polling the agent (a read waits up to
``POLL_S`` for output), through the same framer as a local job's, into the
same store; the runner signals it through the agent. Its stderr stays in a
log on the node; its tail is copied into the job's log here at its end, so
a failed job says why as a local one does. A node lost mid-job raises
:class:`~supervisor.lab.node_jobs.NodeJobLost` to the runner, which marks
the job ``interrupted`` with the reason.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from jobs.events import Done, Failed, JobEvent
from supervisor.lab.active import ActiveJob, RunnerSettings, StopReason
from supervisor.lab.job_command import job_command
from supervisor.lab.job_process import EventFramer
from supervisor.lab.lease import GpuLease
from supervisor.lab.node_jobs import JobNodes, NodeJob, NodeJobLost
from supervisor.lab.store import JobStore
from supervisor.models.gpu_reading import device_node

log = logging.getLogger(__name__)

# How long one read waits on the node for the job's output: a bound on how
# late an event or the job's end is seen here.
POLL_S = 0.5


class NodeSpawnFailed(OSError):
    """The node's agent could not start the job process."""


def job_node(devices: list[str]) -> str:
    """The one cluster node these devices are on ("" for this machine's)."""
    nodes = {device_node(d) for d in devices}
    if len(nodes) > 1:
        raise ValueError(f"a job runs on one machine; its devices are on {', '.join(sorted(nodes))}")
    return nodes.pop() if nodes else ""


class NodeJobExecution:
    def __init__(
        self,
        nodes: JobNodes,
        store: JobStore,
        lease: GpuLease,
        settings: RunnerSettings,
        request_stop: Callable[[ActiveJob, StopReason], None],
        signal_stop: Callable[[ActiveJob, bool], None],
    ) -> None:
        self.nodes = nodes
        self.store = store
        self.lease = lease
        self.settings = settings
        self._request_stop = request_stop
        self._signal_stop = signal_stop

    async def run(self, active: ActiveJob, node: str, devices: list[str], log_path: Path) -> int:
        """Start the job on ``node`` (its devices, if any, are that node's),
        store its events; its exit status. NodeSpawnFailed when it cannot
        start, NodeJobLost when its node went."""
        job = active.job
        # Pinned even when it books none: a job that holds no GPU there must use none of the node's.
        cmd = job_command(job, self.settings, self.lease.gpu_indices(devices))
        try:
            proc = await self.nodes.start_job(node, cmd.argv, cmd.env, cmd.stdin_line, log_path.name)
        except OSError as exc:
            raise NodeSpawnFailed(f"on node {node}: {exc}") from exc
        active.pgid = proc.pid
        active.send = proc.signal
        lost = False
        try:
            # No create_time: boot recovery never kills a pid of another machine here.
            await self.store.mark_running(job.id, pid=proc.pid, pgid=proc.pid, create_time=None,
                                          log_path=str(log_path))
            if active.stop_reason is not None:
                self._signal_stop(active, active.stop_reason == "heartbeat")
            return await self._pump(active, proc)
        except NodeJobLost:
            lost = True
            raise
        finally:
            # ``send`` stays: a pid of another machine must never be signalled here.
            if not lost:
                await self._finish_on_node(active, proc, log_path)

    async def _finish_on_node(self, active: ActiveJob, proc: NodeJob, log_path: Path) -> None:
        """Copy the log's tail here, then reap what is left there."""
        try:
            tail = await proc.log_tail()
            if tail:
                with log_path.open("a", encoding="utf-8") as f:
                    f.write(tail + "\n")
        except OSError as exc:  # ClusterError is one: the job's outcome stands without its tail
            log.warning("job %s: no log tail from its node: %s", active.job.id, exc)
        try:
            await proc.cleanup()
        except OSError as exc:
            # Its exit status is known; what is left there ends with its stdin when the agent goes.
            log.warning("job %s: its node's agent could not reap it: %s", active.job.id, exc)

    async def _pump(self, active: ActiveJob, proc: NodeJob) -> int:
        """Store events until the job ends; stop it when heartbeats stop."""
        loop = asyncio.get_running_loop()
        framer = EventFramer(self.settings.max_line_bytes)
        timeout = self.settings.heartbeat_timeout_s
        last_output = last_touch = loop.time()
        while True:
            data, rc = await proc.read(POLL_S)
            framed = framer.feed(data) if rc is None else framer.finish()
            if data:
                last_output = loop.time()
            if framed.events:
                await self._store_events(active, framed.events)
                last_touch = loop.time()
            elif framed.keepalives and loop.time() - last_touch > self.settings.keepalive_s:
                await self.store.touch(active.job.id)
                last_touch = loop.time()
            if rc is not None:
                return rc
            if loop.time() - last_output > timeout:
                log.warning("job %s sent nothing for %.0f s: killing it", active.job.id, timeout)
                self._request_stop(active, "heartbeat")
                timeout = self.settings.stop_timeout_s + 60.0
                last_output = loop.time()

    async def _store_events(self, active: ActiveJob, events: list[JobEvent]) -> None:
        for event in events:
            if isinstance(event, Done | Failed) and active.terminal is None:
                active.terminal = event
        await self.store.append_events(active.job.id, events)
