"""A node job's log, copied here while the job runs, bounded in size.

A job on a cluster node writes its stderr to a log on that node
(supervisor/workers/node_agent.py). The parent copies it into the job's log
here as it grows, every ``POLL_S`` at most, so the job page shows it live
as for a local job. At most ``max_bytes`` are copied: a job that logs more
(a chatty library, a loop gone wrong) would fill the parent's disk and
Ray's traffic with it, so past the bound one line says where the rest is,
and at the job's end the log's tail follows, so a failure still says why.
"""

from __future__ import annotations

import logging
from pathlib import Path

from supervisor.lab.node_jobs import NodeJob

log = logging.getLogger(__name__)

# How often the log is read from the node while the job runs.
POLL_S = 1.0
# The most one read asks of the agent.
READ_BYTES = 1 << 16


class NodeLogCopy:
    def __init__(self, proc: NodeJob, path: Path, node: str, max_bytes: int) -> None:
        self.proc = proc
        self.path = path
        self.node = node
        self.max_bytes = max_bytes
        self.copied = 0  # bytes of the node's log copied so far (its offset there)
        self.capped = False
        self._next = 0.0
        self._last_error = ""

    async def poll(self, now: float) -> None:
        """Copy what is new, if ``POLL_S`` passed since the last look."""
        if now < self._next:
            return
        self._next = now + POLL_S
        try:
            await self.pull()
        except OSError as exc:  # ClusterError: the job's own reads say whether its node is gone
            if str(exc) != self._last_error:
                log.warning("job log %s: not read from node %s: %s", self.path.name, self.node, exc)
                self._last_error = str(exc)

    async def pull(self) -> None:
        """Copy what the node's log has beyond what is here, up to the bound."""
        while not self.capped:
            want = min(READ_BYTES, self.max_bytes - self.copied)
            if want <= 0:
                self._write(f"\n[the rest of this log stays on node {self.node}: only its first {self.max_bytes} "
                            "bytes are copied while the job runs; its tail follows at the end]\n".encode())
                self.capped = True
                return
            data = await self.proc.read_log(self.copied, want)
            if data:
                self._write(data)
                self.copied += len(data)
            if len(data) < want:
                return

    async def finish(self) -> None:
        """At the job's end: the rest of its log, or past the bound its tail."""
        await self.pull()
        if self.capped:
            tail = await self.proc.log_tail()
            if tail:
                self._write(f"[... the end of the log on node {self.node}:]\n{tail}\n".encode())

    def _write(self, data: bytes) -> None:
        with self.path.open("ab") as f:
            f.write(data)
