"""Assembling the GPU side at start-up: the device source, the lease, the pool's GPU room.

One :class:`~supervisor.models.devices.DeviceSource` feeds all of them: the
lease's device list, the settle wait and the placement read the same GPUs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from supervisor.lab.lease import GpuLease, device_from_id, devices_from_readings
from supervisor.models.devices import DeviceReadError, DeviceSource, SystemSource
from supervisor.models.gpu_place import DEFAULT_HEADROOM
from supervisor.models.settle import Settler
from supervisor.workers.gpu_room import GpuRoom

log = logging.getLogger("gpuvisor.lease")


async def build_lease(configured: Sequence[str] = (), source: DeviceSource | None = None, *,
                      drain_timeout: float = 30.0, settle_timeout: float = 10.0) -> GpuLease:
    """Configured device ids win; else the GPUs the source reports; none: ``cpu``."""
    source = SystemSource() if source is None else source
    if configured:
        devices = [device_from_id(d) for d in configured]
    else:
        try:
            devices = devices_from_readings(await asyncio.to_thread(source.read))
        except DeviceReadError as exc:
            # Loud, not silent: the service still runs, on the CPU.
            log.error("cannot read the GPUs (%s): models and jobs run on the CPU", exc)
            devices = devices_from_readings([])
    return GpuLease(devices, drain_timeout=drain_timeout, settler=Settler(source, timeout=settle_timeout))


def gpu_room(lease: GpuLease, headroom: float = DEFAULT_HEADROOM) -> GpuRoom | None:
    """The pool's view of the lease's GPUs; None without readings to place by."""
    if lease.settler is None:
        return None
    return GpuRoom(lease.settler, lease.devices, lease.worker_admission, headroom)
