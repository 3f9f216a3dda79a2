"""The nodes of a Ray cluster as the lease and placement see them.

With ``ray_address`` set, the pool keeps one ``ClusterNodes``: it lists the
cluster's alive nodes (supervisor/workers/ray_launcher.py), asks each one's
node agent for its memory (node_agent.NodeAgent.read_memory: nvidia-smi,
else amd-smi or rocm-smi there), and keeps the lease's books in step
(supervisor/lab/lease.py):

- a node that joins adds its GPUs as ``node/cuda:N`` devices, as many as its
  logical GPUs (``ray start --num-gpus``), in the GPU tool's order; a node
  with logical GPUs where no GPU is found runs models in its RAM,
  with one device, ``node/cpu``;
- a node that leaves (the cluster no longer lists it alive) takes its
  devices out of the lease, and the pool is told (``on_lost``), so that its
  workers there end with the reason and their models are placed again.

It looks every ``poll_s`` seconds, and afresh before each placement. A node
whose agent does not answer keeps its last reading until the cluster says
whether it is alive: a slow answer is not a lost node.

The settle wait, on nodes: a worker stopped on a node's GPU frees its memory
late (the driver tears its context down after it exits). Whoever stops one
says what should come back (:meth:`ClusterNodes.expect_freed`), and the next
placement reads the nodes again until it shows, or ``settle_s`` passes, as
supervisor/models/settle.py does for this machine's GPUs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from supervisor.models.gpu_reading import DeviceReadError, GpuReading, node_device
from supervisor.models.settle import EVICTED_SHARE
from supervisor.workers.ray_launcher import ClusterError, ClusterNode, RayLauncher

log = logging.getLogger("gpuvisor.cluster")

# How often the nodes are listed and read between placements.
POLL_S = 2.0
# The settle wait's bound, and how often it reads the nodes meanwhile.
SETTLE_S = 10.0
SETTLE_INTERVAL_S = 0.25


@runtime_checkable
class NodeBook(Protocol):
    """The lease's side: the devices of each node (supervisor/lab/lease.py)."""

    def set_node(self, node: str, readings: Sequence[GpuReading],
                 ram: tuple[int, int] | None = None) -> list[str]: ...

    def drop_node(self, node: str) -> list[str]: ...


# Told (node name, reason) when a node left: its workers are gone.
NodeLost = Callable[[str, str], None]


class ClusterNodes:
    def __init__(self, launcher: RayLauncher, book: NodeBook, on_lost: NodeLost, *,
                 on_joined: Callable[[str], None] | None = None, poll_s: float = POLL_S, settle_s: float = SETTLE_S,
                 settle_interval_s: float = SETTLE_INTERVAL_S, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.launcher = launcher
        self.book = book
        self.on_lost = on_lost
        # Told a node's name when it joins (its own disk's models become usable).
        self.on_joined = on_joined
        self.poll_s = poll_s
        self.settle_s = settle_s
        self.settle_interval_s = settle_interval_s
        # Injected so that tests never really sleep through a settle wait.
        self._clock = clock
        self._sleep = sleep
        # Device id -> the free bytes it should show again (a worker stopped there).
        self._expected: dict[str, int] = {}
        # Node name -> its GPUs as last read (the ones the lease has).
        self.readings: dict[str, list[GpuReading]] = {}
        # Nodes with logical GPUs but no GPU found there: their RAM (free, total).
        self.ram: dict[str, tuple[int, int]] = {}
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._last_error = ""

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="cluster-nodes")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def device_ids(self) -> list[str]:
        return [r.device_id for rs in self.readings.values() for r in rs] + [
            node_device(n, "cpu") for n in self.ram]

    def serving(self) -> list[str]:
        """The nodes whose devices are in the lease now (alive, with GPUs or RAM to serve)."""
        return [*self.readings, *self.ram]

    def ram_nodes(self) -> dict[str, int]:
        """The free RAM of each node without a GPU, as last read."""
        return {n: free for n, (free, _) in self.ram.items()}

    def expect_freed(self, freed: dict[str, int]) -> None:
        """Workers planned to use ``freed`` bytes per device are being stopped:
        the next placement waits for most of that memory to show free."""
        for r in (r for rs in self.readings.values() for r in rs):
            if r.device_id in freed:
                want = r.free_bytes + int(freed[r.device_id] * EVICTED_SHARE)
                self._expected[r.device_id] = max(want, self._expected.get(r.device_id, 0))

    async def fresh_readings(self) -> list[GpuReading]:
        """Every node's GPUs, read now (for a placement), once the memory of
        stopped workers is back or the settle bound passed; DeviceReadError
        when the cluster cannot be reached."""
        deadline = self._clock() + self.settle_s
        while True:
            try:
                await self.refresh()
            except ClusterError as exc:
                raise DeviceReadError(f"cannot list the cluster's nodes: {exc}") from exc
            readings = [r for rs in self.readings.values() for r in rs]
            free = {r.device_id: r.free_bytes for r in readings}
            # A device gone with its node cannot be waited for.
            self._expected = {d: want for d, want in self._expected.items() if free.get(d, want) < want}
            if not self._expected:
                return readings
            if self._clock() >= deadline:
                log.warning("GPU memory on %s not freed within %.1fs; placing with what is free now",
                            ", ".join(sorted(self._expected)), self.settle_s)
                self._expected.clear()
                return readings
            await self._sleep(self.settle_interval_s)

    async def refresh(self) -> None:
        """List the alive nodes, read them, and bring the lease's books in step."""
        async with self._lock:
            nodes = await self.launcher.alive_nodes()
            alive = {n.name for n in nodes}
            for name in [n for n in [*self.readings, *self.ram] if n not in alive]:
                self._lost(name, f"node {name} left the cluster")
            serving = [n for n in nodes if n.gpus > 0]
            read = await asyncio.gather(*(self._read(n) for n in serving))
            for node, got in zip(serving, read, strict=True):
                if got is not None:
                    self._found(node, got)

    async def _read(self, node: ClusterNode) -> dict[str, Any] | None:
        """The node agent's reading; None when it did not answer."""
        try:
            return await self.launcher.read_node(node.node_id)
        except ClusterError as exc:
            log.warning("node %s: no memory reading (%s); keeping its last one", node.name, exc)
            return None

    def _found(self, node: ClusterNode, got: dict[str, Any]) -> None:
        name = node.name
        readings = node_readings(node, got)
        ram = None if readings else node_ram(got)
        # A node whose GPUs appear or vanish while it is alive: its workers ran on the other kind.
        if (name in self.readings and ram is not None) or (name in self.ram and readings):
            self._lost(name, f"node {name} {'no longer reports its GPUs' if ram else 'now reports GPUs'}")
        joined = self.book.set_node(name, readings, ram)
        if ram is not None:
            self.ram[name] = ram
        else:
            self.readings[name] = readings
        if joined:
            log.info("node %s joined with %s%s", name, ", ".join(joined),
                     " (no GPU found there: models run in its RAM)" if ram is not None else "")
            if self.on_joined is not None:
                self.on_joined(name)

    def _lost(self, name: str, reason: str) -> None:
        self.readings.pop(name, None)
        self.ram.pop(name, None)
        holders = self.book.drop_node(name)
        log.warning("%s: its devices leave the lease (workers there: %s)", reason, ", ".join(holders) or "none")
        self.on_lost(name, reason)

    async def _watch(self) -> None:
        while True:
            try:
                await self.refresh()
                self._last_error = ""
            except ClusterError as exc:
                # Said once per new error: a cluster down for an hour is one line.
                if str(exc) != self._last_error:
                    log.warning("cannot list the cluster's nodes: %s", exc)
                    self._last_error = str(exc)
            await asyncio.sleep(self.poll_s)


def node_ram(got: dict[str, Any]) -> tuple[int, int]:
    """A node agent's RAM reading: (available, total) bytes."""
    free, total = got.get("ram") or (0, 0)
    return int(free), int(total)


def node_readings(node: ClusterNode, got: dict[str, Any]) -> list[GpuReading]:
    """A node agent's answer as readings named by the node: its first
    ``node.gpus`` GPUs (``--num-gpus`` caps how many gpuvisor uses there)."""
    gpus = sorted(got.get("gpus") or [], key=lambda g: int(g[0]))
    return [GpuReading(index=int(g[0]), uuid=str(g[1]), name=str(g[2]), free_bytes=int(g[3]),
                       total_bytes=int(g[4]), node=node.name) for g in gpus[:node.gpus]]
