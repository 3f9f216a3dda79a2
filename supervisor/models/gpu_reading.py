"""One GPU's reading, whichever tool took it (nvidia-smi, amd-smi, rocm-smi, sysfs)."""

from __future__ import annotations

import msgspec

MIB = 1024 * 1024


class DeviceReadError(Exception):
    """The GPU readings could not be taken (the tool failed or printed nonsense)."""


class GpuReading(msgspec.Struct, frozen=True, kw_only=True):
    """One GPU as the driver reports it; ``index`` is the tool's GPU index,
    the one ``CUDA_VISIBLE_DEVICES`` or ``ROCR_VISIBLE_DEVICES`` selects
    (on its own machine: ``node`` names that machine in a cluster, and is
    empty for this one)."""

    index: int
    uuid: str
    name: str
    free_bytes: int
    total_bytes: int
    node: str = ""

    @property
    def device_id(self) -> str:
        """Its id in the GPU lease: ``cuda:N`` on ROCm too, as torch and HIP
        name it; ``node-a/cuda:N`` on a cluster's node."""
        return node_device(self.node, f"cuda:{self.index}")


def node_device(node: str, local_id: str) -> str:
    """A device id: ``local_id`` on this machine, ``node/local_id`` on a cluster's node."""
    return f"{node}/{local_id}" if node else local_id


def device_node(device_id: str) -> str:
    """The node a device id names ("" for this machine's own devices)."""
    node, sep, _ = device_id.rpartition("/")
    return node if sep else ""
