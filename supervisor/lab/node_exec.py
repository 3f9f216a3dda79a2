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
same store; the runner signals it through the agent. Its stderr goes to a
log on the node, copied into the job's log here while it runs, bounded
(node_log.py), so the job page shows it live and a failed job says why as
a local one does. A download there fills that
node's own Hub cache; its result names the node, and its files are
recorded (supervisor/lab/node_files.py) for the library and placement.
A node lost mid-job raises
:class:`~supervisor.lab.node_jobs.NodeJobLost` to the runner, which marks
the job ``interrupted`` with the reason.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec

from jobs.events import Done, Failed, JobEvent
from supervisor.errors import ApiError
from supervisor.lab.active import ActiveJob, RunnerSettings, StopReason
from supervisor.lab.job_command import job_command
from supervisor.lab.job_process import EventFramer
from supervisor.lab.lease import GpuLease
from supervisor.lab.node_files import NodeFiles, is_model_file
from supervisor.lab.node_jobs import JobNodes, NodeJob, NodeJobLost
from supervisor.lab.node_log import NodeLogCopy
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


def _on_node(event: JobEvent, node: str) -> JobEvent:
    """A download's result names the node whose cache holds its files."""
    if node and isinstance(event, Done):
        return msgspec.structs.replace(event, data={**event.data, "result": {**event.result, "node": node}})
    return event


class NodeJobExecution:
    def __init__(
        self,
        nodes: JobNodes,
        store: JobStore,
        lease: GpuLease,
        settings: RunnerSettings,
        request_stop: Callable[[ActiveJob, StopReason], None],
        signal_stop: Callable[[ActiveJob, bool], None],
        files: NodeFiles | None = None,
        relist: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.nodes = nodes
        self.store = store
        self.lease = lease
        self.settings = settings
        self._request_stop = request_stop
        self._signal_stop = signal_stop
        # Where downloads into nodes' own caches are recorded, and who lists them.
        self.files: NodeFiles | None = files
        # Lists the recorded models again (node_models.NodeModels.relist).
        self.relist = relist

    async def run(self, active: ActiveJob, node: str, devices: list[str], log_path: Path) -> int:
        """Start the job on ``node`` (its devices, if any, are that node's),
        store its events; its exit status. NodeSpawnFailed when it cannot
        start, NodeJobLost when its node went."""
        job = active.job
        # A download on a node fills that node's own Hub cache (its HF_HOME there), not the shared one.
        own_cache = job.kind == "download"
        # Pinned even when it books none: a job that holds no GPU there must use none of the node's.
        cmd = job_command(job, self.settings, self.lease.gpu_indices(devices), own_hub_cache=own_cache)
        try:
            proc = await self.nodes.start_job(node, cmd.argv, cmd.env, cmd.stdin_line, log_path.name)
        except OSError as exc:
            raise NodeSpawnFailed(f"on node {node}: {exc}") from exc
        active.pgid = proc.pid
        active.send = proc.signal
        copy = NodeLogCopy(proc, log_path, node, self.settings.node_log_max_bytes)
        lost = False
        try:
            # No create_time: boot recovery never kills a pid of another machine here.
            await self.store.mark_running(job.id, pid=proc.pid, pgid=proc.pid, create_time=None,
                                          log_path=str(log_path))
            if active.stop_reason is not None:
                self._signal_stop(active, active.stop_reason == "heartbeat")
            rc = await self._pump(active, proc, copy, node if own_cache else "")
            if rc == 0 and own_cache and isinstance(active.terminal, Done):
                await self._record_files(node, active.job.id, active.terminal.result)
            return rc
        except NodeJobLost:
            lost = True
            raise
        finally:
            # ``send`` stays: a pid of another machine must never be signalled here.
            if not lost:
                await self._finish_on_node(active, proc, copy)

    async def _finish_on_node(self, active: ActiveJob, proc: NodeJob, copy: NodeLogCopy) -> None:
        """Copy the rest of its log here (node_log.py), then reap what is left there."""
        try:
            await copy.finish()
        except OSError as exc:  # ClusterError is one: the job's outcome stands without its log's end
            log.warning("job %s: the end of its log did not come from its node: %s", active.job.id, exc)
        try:
            await proc.cleanup()
        except OSError as exc:
            # Its exit status is known; what is left there ends with its stdin when the agent goes.
            log.warning("job %s: its node's agent could not reap it: %s", active.job.id, exc)

    async def _record_files(self, node: str, job_id: str, result: dict[str, Any]) -> None:
        """Record what a download left in ``node``'s own cache, with its
        model's header as the node's agent reads it there, and tell the library."""
        if self.files is None:
            return
        header = None
        model = result.get("model_id")
        path = next((f["local_path"] for f in result.get("files") or [] if is_model_file(f)), None)
        if model and path:
            try:
                header = await self.nodes.read_model(node, str(path))
            except OSError as exc:  # ClusterError, or the file's header unreadable there
                log.warning("job %s: no header of %s from node %s: %s", job_id, model, node, exc)
        try:
            await self.files.record_download(node, job_id, result, header)
        except (OSError, ApiError) as exc:  # StorageFull: the download stands, the library misses it
            log.error("job %s: could not record the files it left on node %s: %s", job_id, node, exc)
            return
        if self.relist is not None:
            await self.relist()

    async def _pump(self, active: ActiveJob, proc: NodeJob, copy: NodeLogCopy, own_cache_node: str = "") -> int:
        """Store events until the job ends; stop it when heartbeats stop.
        ``own_cache_node``: a download into that node's cache, whose result says so."""
        loop = asyncio.get_running_loop()
        framer = EventFramer(self.settings.max_line_bytes)
        timeout = self.settings.heartbeat_timeout_s
        last_output = last_touch = loop.time()
        while True:
            data, rc = await proc.read(POLL_S)
            if rc is None:
                await copy.poll(loop.time())  # its log, live (the rest comes at its end)
            framed = framer.feed(data) if rc is None else framer.finish()
            if data:
                last_output = loop.time()
            if framed.events:
                await self._store_events(active, [_on_node(e, own_cache_node) for e in framed.events])
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
