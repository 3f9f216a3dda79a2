"""One GPU's reading, whichever tool took it (nvidia-smi, amd-smi, rocm-smi, sysfs)."""

from __future__ import annotations

import msgspec

MIB = 1024 * 1024


class DeviceReadError(Exception):
    """The GPU readings could not be taken (the tool failed or printed nonsense)."""


class GpuReading(msgspec.Struct, frozen=True, kw_only=True):
    """One GPU as the driver reports it; ``index`` is the tool's GPU index,
    the one ``CUDA_VISIBLE_DEVICES`` or ``ROCR_VISIBLE_DEVICES`` selects."""

    index: int
    uuid: str
    name: str
    free_bytes: int
    total_bytes: int

    @property
    def device_id(self) -> str:
        """Its id in the GPU lease: ``cuda:N`` on ROCm too, as torch and HIP name it."""
        return f"cuda:{self.index}"
