"""Room on the GPUs: per-GPU readings, the placement of a load, the settle wait.

``GpuRoom`` is the pool's view of the GPUs the lease manages. Before it
measures for a placement it waits for memory that an eviction or a job's end
should give back (supervisor/models/settle.py); it then places the load on
the GPUs model workers may use now (supervisor/models/gpu_place.py). With no
GPU in the lease the pool keeps its plain path: free RAM (or all visible GPU
memory as one) through supervisor/models/placement.py.

On a Ray cluster (``nodes``), the GPUs are the nodes' (node/cuda:N, read by
their agents: supervisor/workers/cluster_nodes.py, which also runs their
settle wait), and a load goes on one node (supervisor/models/gpu_place.py,
``place_on_nodes``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import msgspec

from supervisor.errors import DeviceBusy, Unavailable
from supervisor.models.devices import DeviceReadError, GpuReading
from supervisor.models.gpu_reading import node_device
from supervisor.models.gpu_place import (
    DEFAULT_HEADROOM,
    GpuPlacement,
    Plan,
    place,
    place_on_nodes,
    usable_bytes,
)
from supervisor.models.memfit import ContextDecision
from supervisor.models.placement import GPU_RUNTIME_RESERVE
from supervisor.models.settle import Settler
from supervisor.workers.handle import WorkerHandle

Admission = Callable[[str], str | None]


class Bookings(Protocol):
    """The lease's record of which devices each model worker is placed on."""

    def book_worker(self, key: str, devices: Sequence[str]) -> None: ...

    def unbook_worker(self, key: str) -> None: ...


def booking_key(key: tuple[str, bool]) -> str:
    return f"{key[0]} (embedding)" if key[1] else key[0]


def handle_key(h: WorkerHandle) -> tuple[str, bool]:
    return (h.spec.model_id, h.spec.embedding)


class NodeReadings(Protocol):
    """A cluster's GPUs (supervisor/workers/cluster_nodes.py)."""

    def device_ids(self) -> list[str]: ...

    def ram_nodes(self) -> dict[str, int]: ...

    def expect_freed(self, freed: dict[str, int]) -> None: ...

    def fresh_readings(self) -> Awaitable[list[GpuReading]]: ...


def worker_devices(h: WorkerHandle) -> list[str]:
    """The lease devices a worker is placed on."""
    return list(h.spec.devices) or [h.spec.device]


@dataclass
class GpuRoom:
    """The lease's GPU devices as the pool places on them."""

    settler: Settler | None  # None on a cluster: no settle wait on nodes yet
    devices: Sequence[str]  # the lease's device ids; only ``cuda:N`` ones are GPUs
    admission: Admission
    headroom: float = DEFAULT_HEADROOM
    nodes: NodeReadings | None = None  # a cluster's nodes: their GPUs instead of this machine's

    def gpu_devices(self) -> list[str]:
        if self.nodes is not None:
            return self.nodes.device_ids()
        return [d for d in self.devices if d.startswith("cuda:")]

    def enabled(self) -> bool:
        # A cluster's nodes come and go: placement goes through them even before the first joins.
        return self.nodes is not None or bool(self.gpu_devices())

    async def readings(self) -> list[GpuReading]:
        """The lease's GPUs as the driver reports them, once freed memory is back."""
        try:
            if self.nodes is not None:
                return await self.nodes.fresh_readings()
            ours = set(self.gpu_devices())
            assert self.settler is not None
            await self.settler.wait()
            return [r for r in await self.settler.read() if r.device_id in ours]
        except DeviceReadError as exc:
            # No placement without readings; a driver hiccup is worth a retry.
            raise Unavailable(f"cannot read the GPUs: {exc}", retry_after=5, code="gpu_unreadable") from exc

    async def open_readings(self) -> list[GpuReading]:
        """The GPUs model workers may use now; 503 naming the holder when none."""
        readings = await self.readings()
        in_ram = bool(self.nodes.ram_nodes()) if self.nodes is not None else False
        if not readings and self.nodes is not None and not in_ram:
            raise Unavailable("no alive node of the cluster offers a GPU yet", retry_after=5, code="no_gpu_node")
        refused = {r.device_id: self.admission(r.device_id) for r in readings}
        open_ = [r for r in readings if refused[r.device_id] is None]
        if not open_ and not in_ram:
            why = next((w for w in refused.values() if w), "no GPU of the lease is reported by the driver")
            raise DeviceBusy(why)
        return open_

    async def ceiling(self, budget_bytes: int) -> int:
        """All GPU memory (less headroom and reserves), capped by the budget."""
        readings = await self.readings()
        total = [msgspec.structs.replace(r, free_bytes=r.total_bytes) for r in readings]
        # A load stays on one node: the largest node's memory is the most it can get.
        by_node: dict[str, list[GpuReading]] = {}
        for r in total:
            by_node.setdefault(r.node, []).append(r)
        ceiling = max((usable_bytes(rs, self.headroom, GPU_RUNTIME_RESERVE) for rs in by_node.values()),
                      default=0)
        if self.nodes is not None:  # nodes without a GPU: their RAM
            ceiling = max([ceiling, *self.nodes.ram_nodes().values()])
        return min(ceiling, budget_bytes) if budget_bytes > 0 else ceiling

    def place_now(self, readings: Sequence[GpuReading], plan: Plan, budget_left: int | None,
                  ram_plan: Plan | None = None,
                  ram: dict[str, int] | None = None) -> tuple[GpuPlacement, ContextDecision | None]:
        """Where the load goes on ``readings``; ``budget_left`` caps the memory of
        any choice. On a cluster, ``ram_plan`` fits it in the free ``ram`` of
        a node without a GPU. Blocking (the plan may read a shard set's
        headers): in a thread."""

        def capped(free: int) -> ContextDecision | None:
            return plan(free if budget_left is None else min(free, budget_left))

        if self.nodes is None:
            return place(readings, headroom=self.headroom, extra_reserve=GPU_RUNTIME_RESERVE, plan=capped)

        def ram_capped(free: int) -> ContextDecision | None:
            assert ram_plan is not None
            return ram_plan(free if budget_left is None else min(free, budget_left))

        return place_on_nodes(readings, headroom=self.headroom, extra_reserve=GPU_RUNTIME_RESERVE, plan=capped,
                              ram=ram, ram_plan=ram_capped if ram_plan is not None else None)

    def ram_left(self, planned: Sequence[tuple[GpuPlacement, int]]) -> dict[str, int]:
        """The free RAM of the cluster's nodes without a GPU, less what
        workers still starting there were planned to use."""
        if self.nodes is None:
            return {}
        used = per_device(planned)
        return {n: max(0, free - used.get(node_device(n, "cpu"), 0)) for n, free in self.nodes.ram_nodes().items()}

    @staticmethod
    def less_planned(readings: Sequence[GpuReading],
                     planned: Sequence[tuple[GpuPlacement, int]]) -> list[GpuReading]:
        """``readings`` with the planned bytes of these placements taken off."""
        used = per_device(planned)
        return [msgspec.structs.replace(r, free_bytes=max(0, r.free_bytes - used.get(r.device_id, 0)))
                for r in readings]

    async def expect_freed(self, victims: Sequence[tuple[GpuPlacement, int]]) -> None:
        """Workers on these placements (with the bytes each was planned to use)
        are about to stop: the settle wait will look for that memory."""
        if self.nodes is not None:  # the settle wait on the nodes' readings
            self.nodes.expect_freed(per_device(victims))
            return
        freed = per_gpu(victims)
        if freed and self.settler is not None:
            before = await self.settler.read()
            self.settler.expect_freed(before, freed)


def per_gpu(planned: Sequence[tuple[GpuPlacement, int]]) -> dict[int, int]:
    """Planned bytes per GPU index, a split placement's shared by its split."""
    out: dict[int, int] = {}
    for placed, needed in planned:
        for index, share in zip(placed.indices, placed.tensor_split or [1.0], strict=False):
            out[index] = out.get(index, 0) + int(needed * share)
    return out


def per_device(planned: Sequence[tuple[GpuPlacement, int]]) -> dict[str, int]:
    """Planned bytes per device id (a node's GPU index is its own), a split
    placement's shared by its split."""
    out: dict[str, int] = {}
    for placed, needed in planned:
        for device, share in zip(placed.devices, placed.tensor_split or [1.0], strict=False):
            out[device] = out.get(device, 0) + int(needed * share)
    return out
