"""The GPU lease: one place decides who may use which device.

Jobs ask for devices with :meth:`GpuLease.acquire_job` and queue FIFO by
priority. When a job reaches the head for a device, the device is reserved for
it at once (model workers are refused from then on), the worker pool is asked
to vacate the device (idle workers evicted, busy ones drained), and then the
job holds it exclusively until :meth:`GpuLease.release_job`, which the runner
calls only after the job's whole process group has exited.

Model workers do not queue: the pool asks :meth:`GpuLease.worker_admission`
before using a device and gets ``None`` (go ahead) or the reason it may not;
it books the devices a worker is placed on (:meth:`GpuLease.book_worker`).
Every device is arbitrated on its own: holders of different devices never
block each other. A job asking for a count of devices gets those with the
fewest holders first (:meth:`GpuLease.preferred`).

With a :class:`~supervisor.models.settle.Settler`, a job's devices are
measured once vacated (after the evicted workers' memory came back), and
their memory is expected back at the job's end.

On a machine without a GPU the lease manages one logical device, ``cpu``, so
the same code paths run everywhere. What a device is, and the list found at
start: supervisor/lab/lease_devices.py (its names stay importable from here).

With a Ray cluster configured, the devices of its nodes join the lease as
node/GPU pairs (``node-a/cuda:0``) while the node is alive
(:meth:`GpuLease.set_node`), and leave with it (:meth:`GpuLease.drop_node`).
Model workers run there. Jobs run there once the runner can start them on
a node (:attr:`GpuLease.jobs_on_nodes`, set by a runner given the cluster):
a job holds devices of one machine only, this one's or one node's
(:meth:`GpuLease.on_one_machine` places a count); without it, a job asking
for a node's device is refused, with the reason.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from supervisor.lab.lease_devices import CPU as CPU
from supervisor.lab.lease_devices import NVIDIA_SMI_QUERY as NVIDIA_SMI_QUERY
from supervisor.lab.lease_devices import Device as Device
from supervisor.lab.lease_devices import cpu_device as cpu_device
from supervisor.lab.lease_devices import cuda_visible_devices as cuda_visible_devices
from supervisor.lab.lease_devices import detect_devices as detect_devices
from supervisor.lab.lease_devices import device_from_id as device_from_id
from supervisor.lab.lease_devices import devices_from_readings as devices_from_readings
from supervisor.lab.lease_devices import parse_nvidia_smi as parse_nvidia_smi
from supervisor.models.devices import DeviceReadError, GpuReading
from supervisor.models.gpu_reading import device_node, node_device
from supervisor.models.settle import Settler

log = logging.getLogger("gpuvisor.lease")

class DeviceUsers(Protocol):
    """What the lease needs from the worker pool."""

    async def vacate(self, device: str, drain_timeout: float, reason: str) -> None:
        """Evict idle workers on the device, drain busy ones (in-flight work
        gets up to ``drain_timeout`` seconds, then is cancelled with an error
        carrying ``reason``); return once their process groups have exited."""
        ...


RequestState = Literal["waiting", "draining", "holding"]


@dataclass(eq=False)
class _Request:
    job_id: str
    label: str
    devices: tuple[str, ...]
    priority: int
    order: int
    enqueued_at: float
    turn: asyncio.Future[None]
    state: RequestState = "waiting"
    since: float = 0.0
    # Free memory of its GPUs once vacated: expected back at its end.
    baseline: tuple[GpuReading, ...] = ()

    def sort_key(self) -> tuple[int, int]:
        return (-self.priority, self.order)


class GpuLease:
    """Exclusive, fair, cancellable device holds for jobs; admission for workers."""

    def __init__(
        self,
        devices: Sequence[Device],
        *,
        drain_timeout: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        settler: Settler | None = None,
    ) -> None:
        if not devices:
            raise ValueError("the lease needs at least one device")
        self._devices = {d.id: d for d in devices}
        self.drain_timeout = drain_timeout
        self._clock = clock
        self._users: DeviceUsers | None = None
        self._requests: dict[str, _Request] = {}
        # Device -> job id of the request that reserved it (draining or holding).
        self._owner: dict[str, str] = {}
        self._order = itertools.count()
        # Worker key -> the devices it is placed on (booked by the pool).
        self._workers: dict[str, tuple[str, ...]] = {}
        self.settler = settler
        # The latest memory readings of the cluster nodes' GPUs (shown in the snapshot).
        self._node_readings: dict[str, tuple[GpuReading, ...]] = {}
        # Free and total RAM of the nodes without a GPU (their one device: node/cpu).
        self._node_ram: dict[str, tuple[int, int]] = {}
        # Whether jobs may hold a node's devices (a runner that starts jobs there says so).
        self.jobs_on_nodes = False

    # ------------------------------------------------------------ devices

    @property
    def devices(self) -> list[str]:
        return list(self._devices)

    def device(self, device_id: str) -> Device:
        return self._devices[device_id]

    @property
    def default_device(self) -> str:
        return next(iter(self._devices))

    def set_users(self, users: DeviceUsers) -> None:
        self._users = users

    def preferred(self) -> list[str]:
        """Devices in the order a job asking for a count should take them:
        this machine's own first (jobs run here), then those no job holds or
        waits for, then those with fewer workers."""
        wanted = {d for r in self._requests.values() for d in r.devices}
        order = {d: i for i, d in enumerate(self._devices)}
        workers = self.workers_on()
        return sorted(self._devices, key=lambda d: (bool(self._devices[d].node), d in wanted,
                                                    len(workers[d]), order[d]))

    def on_one_machine(self, picked: Sequence[str]) -> list[str]:
        """A job's devices taken by count, all on one machine: ``picked`` when
        they are; else as many from the first machine (this one, then the
        nodes) that has that many, in :meth:`preferred` order. ValueError
        when none has."""
        places = {self._devices[d].node for d in picked if d in self._devices}
        if len(places) <= 1:
            return list(picked)
        by_place: dict[str, list[str]] = {}
        for d in self.preferred():
            by_place.setdefault(self._devices[d].node, []).append(d)
        for devices in by_place.values():
            if len(devices) >= len(picked):
                return devices[: len(picked)]
        raise ValueError(f"no machine has {len(picked)} devices; a job runs on one machine "
                         f"(this one has {len(by_place.get('', []))})")

    def gpu_indices(self, device_ids: Sequence[str]) -> list[int]:
        """The GPU indices of these devices (none for ``cpu``)."""
        return [i for i in (self._devices[d].index for d in device_ids) if i is not None]

    # ------------------------------------------------------------ worker bookings

    def book_worker(self, key: str, devices: Sequence[str]) -> None:
        """A model worker is placed on ``devices`` (shown in the snapshot)."""
        self._workers[key] = tuple(d for d in devices if d in self._devices)

    def unbook_worker(self, key: str) -> None:
        self._workers.pop(key, None)

    # ------------------------------------------------------------ cluster nodes

    def set_node(self, node: str, readings: Sequence[GpuReading],
                 ram: tuple[int, int] | None = None) -> list[str]:
        """A cluster node's GPUs as its agent read them just now: new ones join
        the lease, and their memory is shown. A node without a GPU gives its
        RAM (free, total) instead: its one device is ``node/cpu``. The ids
        that joined."""
        joined = []
        if ram is not None and not readings:
            device_id = node_device(node, CPU)
            if device_id not in self._devices:
                joined.append(device_id)
            self._devices[device_id] = Device(device_id, "CPU (no GPU on this node)", None, ram[1] >> 20, node)
            self._node_ram[node] = ram
            self._node_readings[node] = ()
            return joined
        for r in readings:
            if r.node != node:
                raise ValueError(f"a reading of node {r.node!r} given as node {node!r}'s")
            if r.device_id not in self._devices:
                joined.append(r.device_id)
            self._devices[r.device_id] = Device(r.device_id, r.name, r.index, r.total_bytes >> 20, node)
        self._node_readings[node] = tuple(readings)
        return joined

    def drop_node(self, node: str) -> list[str]:
        """A node left the cluster: its devices leave the lease, and the
        workers booked on them are unbooked. The worker keys that were there."""
        self._node_readings.pop(node, None)
        self._node_ram.pop(node, None)
        gone = {d for d, dev in self._devices.items() if dev.node == node}
        for d in gone:
            del self._devices[d]
        holders = [k for k, devices in self._workers.items() if gone & set(devices)]
        for key in holders:
            del self._workers[key]
        return holders

    def node_memory(self, device_id: str) -> tuple[int, int] | None:
        """A cluster node's device's (free, total) bytes as its agent last read
        them: its GPU's, or the node's RAM for ``node/cpu``. None for this
        machine's devices (read them with the settler) and before a reading."""
        dev = self._devices[device_id]
        if not dev.node:
            return None
        if dev.index is None:
            return self._node_ram.get(dev.node)
        found = (r for r in self._node_readings.get(dev.node, ()) if r.device_id == device_id)
        reading = next(found, None)
        return None if reading is None else (reading.free_bytes, reading.total_bytes)

    def nodes(self) -> list[str]:
        """The cluster nodes whose devices the lease has."""
        return list(self._node_readings)

    def workers_on(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {d: [] for d in self._devices}
        for key, devices in self._workers.items():
            for d in devices:
                out[d].append(key)
        return out

    # ------------------------------------------------------------ jobs

    async def acquire_job(self, job_id: str, label: str, devices: list[str], priority: int) -> None:
        """Wait for the devices (FIFO by priority), vacate them, then hold them.

        Cancelling the caller while it waits or drains leaves the queue clean.
        """
        if job_id in self._requests:
            raise RuntimeError(f"job {job_id} already has a lease request")
        unknown = [d for d in devices if d not in self._devices]
        if unknown or not devices:
            raise ValueError(f"unknown devices {unknown or devices!r}; known: {self.devices}")
        on_nodes = [d for d in devices if device_node(d)]
        if on_nodes and not self.jobs_on_nodes:
            # No runner here starts jobs on nodes: a node's GPU is not one it can use.
            raise ValueError(f"jobs run on this machine only; {', '.join(on_nodes)} "
                             f"{'is' if len(on_nodes) == 1 else 'are'} on a cluster node")
        places = sorted({device_node(d) or "this machine" for d in devices})
        if len(places) > 1:
            # One process group on one machine: its devices are that machine's.
            raise ValueError(f"a job runs on one machine; its devices are on {', '.join(places)}")
        now = self._clock()
        req = _Request(
            job_id,
            label,
            tuple(dict.fromkeys(devices)),
            priority,
            next(self._order),
            now,
            asyncio.get_running_loop().create_future(),
            since=now,
        )
        self._requests[job_id] = req
        try:
            self._dispatch()
            await req.turn
            await self._vacate(req)
            req.baseline = await self._measure(req)
        except BaseException:
            self._drop(req)
            raise
        req.state = "holding"
        req.since = self._clock()

    def release_job(self, job_id: str) -> None:
        """Give the devices back (after the job's process group is gone)."""
        req = self._requests.get(job_id)
        if req is not None:
            self._drop(req)

    @asynccontextmanager
    async def job(
        self, job_id: str, label: str, devices: list[str], priority: int
    ) -> AsyncIterator[None]:
        """Hold the devices for the body; released however the body ends."""
        await self.acquire_job(job_id, label, devices, priority)
        try:
            yield
        finally:
            self.release_job(job_id)

    def holds(self, job_id: str) -> bool:
        req = self._requests.get(job_id)
        return req is not None and req.state == "holding"

    # ------------------------------------------------------------ workers

    def worker_admission(self, device: str) -> str | None:
        """None when model workers may use the device, else the reason why not."""
        if device not in self._devices:
            return f"device {device} is not managed by this server"
        owner = self._owner.get(device)
        if owner is None:
            return None
        req = self._requests[owner]
        if req.state == "holding":
            return f"device {device} is held by job {req.job_id} ({req.label})"
        return f"device {device} is being freed for job {req.job_id} ({req.label})"

    # ------------------------------------------------------------ reporting

    def snapshot(self, memory: Sequence[GpuReading] = ()) -> dict[str, Any]:
        """Per device: holder, waiters (in turn order), workers, and the
        ``memory`` readings given (the caller reads them: that blocks)."""
        now = self._clock()
        waiters = sorted(
            (r for r in self._requests.values() if r.state == "waiting"), key=_Request.sort_key
        )
        workers = self.workers_on()
        # Readings name their device (a node's GPU index is its own, not this machine's).
        by_id = {r.device_id: r for r in memory}
        by_id.update((r.device_id, r) for rs in self._node_readings.values() for r in rs)
        devices = []
        for dev in self._devices.values():
            owner = self._owner.get(dev.id)
            req = self._requests.get(owner) if owner is not None else None
            reading = by_id.get(dev.id) if dev.index is not None else None
            ram = self._node_ram.get(dev.node) if dev.index is None and dev.node else None
            shown = None if reading is None else {
                "free_mib": reading.free_bytes >> 20, "total_mib": reading.total_bytes >> 20}
            if ram is not None:
                shown = {"free_mib": ram[0] >> 20, "total_mib": ram[1] >> 20}
            devices.append(
                {
                    "id": dev.id,
                    "node": dev.node or None,
                    "name": dev.name,
                    "memory_total_mib": dev.memory_total_mib,
                    "memory": shown,
                    "state": "free" if req is None else req.state,
                    "holder": None if req is None else _describe(req, now),
                    "waiters": [r.job_id for r in waiters if dev.id in r.devices],
                    "workers": workers[dev.id],
                    "why": self.worker_admission(dev.id),
                }
            )
        return {
            "devices": devices,
            "waiters": [_describe(r, now) for r in waiters],
            "drain_timeout": self.drain_timeout,
        }

    # ------------------------------------------------------------ internals

    def _dispatch(self) -> None:
        """Reserve devices for every waiter whose turn it is.

        A waiter is served only if no earlier waiter (by priority, then
        arrival) wants any of its devices, so big requests do not starve.
        """
        blocked: set[str] = set()
        for req in sorted(self._requests.values(), key=_Request.sort_key):
            if req.state != "waiting":
                continue
            wanted = set(req.devices)
            if not (wanted & blocked) and not any(d in self._owner for d in wanted):
                for d in req.devices:
                    self._owner[d] = req.job_id
                req.state = "draining"
                req.since = self._clock()
                if not req.turn.done():
                    req.turn.set_result(None)
            blocked |= wanted

    async def _measure(self, req: _Request) -> tuple[GpuReading, ...]:
        """The job's GPUs once the evicted workers' memory is back."""
        # The settler reads this machine's GPUs: a node's have an index of their own.
        indices = set(self.gpu_indices([d for d in req.devices if d in self._devices and not self._devices[d].node]))
        if self.settler is None or not indices:
            return ()
        try:
            await self.settler.wait(indices)
            return tuple(r for r in await self.settler.read() if r.index in indices)
        except DeviceReadError as exc:
            # The job may run; only the wait for its memory at its end is lost.
            log.warning("job %s: cannot read its GPUs (%s); no settle wait at its end", req.job_id, exc)
            return ()

    async def _vacate(self, req: _Request) -> None:
        users = self._users
        if users is None:
            return
        reason = f"device needed by job {req.job_id} ({req.label})"
        async with asyncio.TaskGroup() as tg:
            for d in req.devices:
                tg.create_task(users.vacate(d, self.drain_timeout, reason))

    def _drop(self, req: _Request) -> None:
        if self._requests.get(req.job_id) is req:
            del self._requests[req.job_id]
        if req.state == "holding" and req.baseline and self.settler is not None:
            self.settler.expect_back(req.baseline)
        for d in req.devices:
            if self._owner.get(d) == req.job_id:
                del self._owner[d]
        if not req.turn.done():
            req.turn.cancel()
        self._dispatch()


def _describe(req: _Request, now: float) -> dict[str, Any]:
    return {
        "job_id": req.job_id,
        "label": req.label,
        "devices": list(req.devices),
        "priority": req.priority,
        "state": req.state,
        "waited_s": round((now if req.state == "waiting" else req.since) - req.enqueued_at, 3),
        "state_for_s": round(now - req.since, 3),
    }
