"""The lease's devices: what each one is, and the list found at start.

A device is this machine's ``cpu`` or ``cuda:N`` (configured, or read from
nvidia-smi), or a cluster node's GPU (``node-a/cuda:0``, supervisor/lab/lease.py
books them as nodes come and go).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from supervisor.models.gpu_reading import GpuReading

log = logging.getLogger("gpuvisor.lease")

CPU = "cpu"
NVIDIA_SMI_QUERY = (
    "nvidia-smi",
    "--query-gpu=index,name,memory.total",
    "--format=csv,noheader,nounits",
)


@dataclass(frozen=True)
class Device:
    id: str
    name: str
    index: int | None = None
    memory_total_mib: int | None = None
    node: str = ""  # the cluster node it is on ("" = this machine)


def cpu_device() -> Device:
    return Device(CPU, "CPU (no GPU detected)")


def device_from_id(device_id: str) -> Device:
    """A configured device id: ``cpu`` or ``cuda:N``."""
    if device_id == CPU:
        return cpu_device()
    prefix, _, idx = device_id.partition(":")
    if prefix != "cuda" or not idx.isdigit():
        raise ValueError(f"device {device_id!r} must be 'cpu' or 'cuda:N'")
    return Device(device_id, device_id, int(idx))


def parse_nvidia_smi(text: str) -> list[Device]:
    """Parse ``index, name, memory.total`` CSV lines (MiB, with or without unit)."""
    devices = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3 or not parts[0].isdigit():
            continue
        mem = parts[-1].split()[0] if parts[-1] else ""
        devices.append(
            Device(
                f"cuda:{parts[0]}",
                ", ".join(parts[1:-1]),
                int(parts[0]),
                int(float(mem)) if mem.replace(".", "", 1).isdigit() else None,
            )
        )
    return devices


async def detect_devices(
    configured: Sequence[str] = (),
    command: Sequence[str] = NVIDIA_SMI_QUERY,
    timeout: float = 10.0,
) -> list[Device]:
    """Configured ids win; else ask nvidia-smi; none or failure -> ``cpu``,
    with the reason logged: at debug level when nvidia-smi is not installed
    (a machine without an NVIDIA GPU, the usual case), else as a warning."""
    if configured:
        return [device_from_id(d) for d in configured]
    tool = command[0]
    try:
        proc = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
    except FileNotFoundError:
        log.debug("%s is not installed: no NVIDIA GPU here, the lease has the CPU", tool)
        return [cpu_device()]
    except OSError as exc:
        log.warning("cannot run %s (%s): the lease has the CPU", tool, exc)
        return [cpu_device()]
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        log.warning("%s did not answer within %g s: the lease has the CPU", tool, timeout)
        return [cpu_device()]
    if proc.returncode != 0:
        log.warning("%s exited with status %s: the lease has the CPU", tool, proc.returncode)
        return [cpu_device()]
    found = parse_nvidia_smi(out.decode(errors="replace"))
    if not found:
        log.debug("%s lists no GPU: the lease has the CPU", tool)
    return found or [cpu_device()]


def cuda_visible_devices(devices: Sequence[Device]) -> str:
    """The CUDA_VISIBLE_DEVICES value exposing exactly these devices."""
    return ",".join(str(d.index) for d in devices if d.index is not None)


def devices_from_readings(readings: Sequence[GpuReading]) -> list[Device]:
    """The lease's devices for these GPUs; ``cpu`` alone when there is none."""
    found = [Device(r.device_id, r.name, r.index, r.total_bytes >> 20, r.node) for r in readings]
    return found or [cpu_device()]
