"""What the job runner needs of a cluster to run a job on one of its nodes.

The runner knows no Ray: with a cluster configured it is given a
:class:`JobNodes` (the RayLauncher, supervisor/workers/ray_launcher.py),
which starts a job process through the node agent of the node its devices
are on and hands back a :class:`NodeJob` to read, signal and reap it.
"""

from __future__ import annotations

from typing import Protocol

from supervisor.workers.node_hub import Removal


class NodeJobLost(Exception):
    """The node (its agent) went away while the job ran: the job's process
    lost its stdin there and ended. The message says which node and why."""


class NodeJob(Protocol):
    """A job process on a cluster node, tended by that node's agent."""

    @property
    def pid(self) -> int: ...

    async def read(self, wait_s: float) -> tuple[bytes, int | None]:
        """Its stdout since the last read (``b""`` when nothing came within
        ``wait_s``), and its exit status once it ended; NodeJobLost when the
        node is gone."""
        ...

    def signal(self, sig: int) -> None:
        """Signal its whole group there (sent, not awaited)."""
        ...

    async def read_log(self, offset: int, max_bytes: int) -> bytes:
        """Up to ``max_bytes`` of its stderr log on the node from ``offset``."""
        ...

    async def log_tail(self) -> str:
        """The end of its stderr log on the node."""
        ...

    async def cleanup(self) -> None:
        """After its end: kill what is left of its group there and forget it."""
        ...


class JobNodes(Protocol):
    async def node_names(self) -> list[str]:
        """The names of the cluster's alive nodes; OSError when it does not answer."""
        ...

    async def read_model(self, node: str, path: str) -> bytes:
        """The GGUF header of the file at ``path`` on ``node``, read there
        (GgufInfo as msgpack); OSError when it cannot be read."""
        ...

    async def start_job(self, node: str, argv: list[str], env: dict[str, str], stdin_line: bytes,
                        log_name: str) -> NodeJob:
        """Start ``python <argv>`` on ``node``; OSError when it cannot."""
        ...

    async def check_hub_files(self, node: str, paths: list[str]) -> dict[str, list[str]]:
        """Which of these files of ``node``'s own Hub cache are there, checked
        by its agent (``present``, ``missing``, ``refused``: not a file of a
        snapshot in that cache); OSError when the node does not answer."""
        ...

    async def remove_hub_files(self, node: str, paths: list[str]) -> Removal:
        """Remove these files of ``node``'s own Hub cache through its agent
        (``removed``, ``missing``, ``refused``: then none is removed,
        ``freed_bytes``); OSError when the node does not answer."""
        ...
