"""GPU readings: which GPUs there are and how much memory each has free.

Everything that looks at GPUs (the lease's device list, the placement of a
model, the settle wait after an eviction) reads them through one
:class:`DeviceSource` passed in, never a global, so tests simulate 1-, 2- and
4-GPU boxes with recorded ``nvidia-smi`` output or NVML-like readings.
:class:`SystemSource` reads NVIDIA GPUs through ``nvidia-smi`` and AMD ones
through ``amd-smi`` or ``rocm-smi`` (:mod:`supervisor.models.amd_smi`).

A source's ``read`` blocks (it may run a tool): call it in a thread.
It raises :class:`DeviceReadError` when the GPUs cannot be read at all; a
machine without any GPU reads as an empty list.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from supervisor.models.amd_smi import AmdSource
from supervisor.models.gpu_reading import MIB as MIB
from supervisor.models.gpu_reading import DeviceReadError as DeviceReadError
from supervisor.models.gpu_reading import GpuReading as GpuReading
from supervisor.models.memory import run_nvidia_smi, visible_devices
from supervisor.models.memory import select_visible as select_entries

SMI_QUERY = "--query-gpu=index,uuid,name,memory.free,memory.total"
SMI_TIMEOUT_S = 10.0


class DeviceSource(Protocol):
    """What every source offers: ``read()`` gives the GPUs the parent may use."""

    def read(self) -> list[GpuReading]: ...


def parse_gpu_csv(text: str) -> list[GpuReading]:
    """``index, uuid, name, memory.free, memory.total`` lines in MiB (a name may hold commas)."""
    out: list[GpuReading] = []
    for line in text.strip().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 5:
            raise DeviceReadError(f"unexpected nvidia-smi line: {line!r}")
        try:
            index, free, total = int(fields[0]), _mib(fields[-2]), _mib(fields[-1])
        except ValueError as exc:
            raise DeviceReadError(f"unexpected nvidia-smi line: {line!r}") from exc
        out.append(GpuReading(index=index, uuid=fields[1], name=", ".join(fields[2:-2]),
                              free_bytes=free, total_bytes=total))
    return out


def _mib(field: str) -> int:
    # With ``nounits`` a plain number; without, "1234 MiB".
    return int(float(field.split()[0])) * MIB


def select_visible(readings: list[GpuReading], environ: Mapping[str, str]) -> list[GpuReading]:
    """The GPUs the parent's own CUDA_VISIBLE_DEVICES leaves it (all when unset)."""
    return select_entries(readings, visible_devices(environ))


def run_smi() -> str:
    """nvidia-smi's memory query; FileNotFoundError when it is not installed."""
    return run_nvidia_smi(SMI_QUERY, SMI_TIMEOUT_S)


class SmiSource:
    """Readings from ``nvidia-smi`` (or recorded output of it: ``run``)."""

    def __init__(self, run: Callable[[], str] = run_smi,
                 environ: Mapping[str, str] | None = None) -> None:
        self._run = run
        self._environ = os.environ if environ is None else environ

    def read(self) -> list[GpuReading]:
        try:
            text = self._run()
        except FileNotFoundError:
            return []  # no NVIDIA driver: a machine without GPUs
        except (OSError, subprocess.SubprocessError) as exc:
            raise DeviceReadError(f"nvidia-smi failed: {exc}") from exc
        return select_visible(parse_gpu_csv(text), self._environ)


class SystemSource:
    """The machine's GPUs: NVIDIA ones through nvidia-smi, else AMD ones.

    The first source that shows GPUs is kept for every later reading, so an
    AMD box does not ask a broken nvidia-smi each time. Failures of every
    source, with no GPU seen, are one DeviceReadError naming each.
    """

    def __init__(self, sources: Sequence[tuple[str, DeviceSource]] | None = None) -> None:
        self._sources: list[tuple[str, DeviceSource]] = list(sources) if sources is not None else [
            ("nvidia-smi", SmiSource()), ("amd", AmdSource())]
        self.chosen: str | None = None

    def read(self) -> list[GpuReading]:
        if self.chosen is not None:
            return dict(self._sources)[self.chosen].read()
        failures: list[str] = []
        for name, source in self._sources:
            try:
                found = source.read()
            except DeviceReadError as exc:
                failures.append(str(exc))
                continue
            if found:
                self.chosen = name
                return found
        if failures:
            raise DeviceReadError("; ".join(failures))
        return []


class RecordedSource:
    """Readings replayed in order: recorded nvidia-smi CSV text or NVML-like
    lists of :class:`GpuReading`. Each read takes the next; the last repeats."""

    def __init__(self, frames: Sequence[str | Sequence[GpuReading]]) -> None:
        if not frames:
            raise ValueError("a recorded source needs at least one frame")
        self._frames = list(frames)
        self.reads = 0

    def read(self) -> list[GpuReading]:
        frame = self._frames[min(self.reads, len(self._frames) - 1)]
        self.reads += 1
        return parse_gpu_csv(frame) if isinstance(frame, str) else list(frame)


def gpu_box(free_mib: Sequence[int], total_mib: int = 24_576, name: str = "Simulated GPU") -> list[GpuReading]:
    """NVML-like readings of a box with one GPU per entry of ``free_mib``."""
    return [GpuReading(index=i, uuid=f"GPU-sim-{i:04d}", name=name, free_bytes=f * MIB,
                       total_bytes=total_mib * MIB) for i, f in enumerate(free_mib)]


# The variables that choose the GPUs a CUDA or ROCm process sees.
VISIBLE_DEVICE_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


def pinned_environ(indices: Sequence[int]) -> dict[str, str]:
    """Environment that shows a child exactly these GPUs (none: an empty list hides all).

    CUDA numbers GPUs fastest first unless told otherwise; nvidia-smi (and so
    the lease) numbers them by PCI bus: make CUDA do the same.

    On ROCm, ``ROCR_VISIBLE_DEVICES`` picks GPUs by the index amd-smi shows,
    and HIP then numbers what is left from 0: ``HIP_VISIBLE_DEVICES`` counts
    within that list, not the machine's (the same index in both hides a
    second GPU). HIP prefers it to ``CUDA_VISIBLE_DEVICES``, which stays the
    machine's index for NVIDIA.
    """
    value = ",".join(str(i) for i in indices)
    within = ",".join(str(i) for i in range(len(indices)))
    return {"CUDA_VISIBLE_DEVICES": value, "ROCR_VISIBLE_DEVICES": value,
            "HIP_VISIBLE_DEVICES": within, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
