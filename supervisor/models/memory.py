"""How much memory is free for a model: the visible GPUs (``nvidia-smi``), else RAM.

:func:`free_memory` respects ``CUDA_VISIBLE_DEVICES`` and blocks for up to a
few seconds: call it in a thread.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Mapping
from typing import Literal, Protocol, TypeVar

import msgspec
import psutil

_MIB = 1024 * 1024
_SMI_QUERY = "--query-gpu=index,uuid,memory.free,memory.total"


class DeviceMemory(msgspec.Struct, frozen=True):
    index: int
    uuid: str
    free_bytes: int
    total_bytes: int


class MemorySnapshot(msgspec.Struct, frozen=True, kw_only=True):
    kind: Literal["gpu", "ram"]
    free_bytes: int
    total_bytes: int
    devices: list[DeviceMemory] = []
    note: str | None = None  # why GPU memory was not used, when it was looked for



def visible_devices(environ: Mapping[str, str], name: str = "CUDA_VISIBLE_DEVICES") -> list[str] | None:
    """CUDA_VISIBLE_DEVICES (or ROCR_VISIBLE_DEVICES: ``name``) as a list of
    entries; None when unset (all visible)."""
    value = environ.get(name)
    if value is None:
        return None
    out: list[str] = []
    for part in (p.strip() for p in value.split(",")):
        # CUDA (and ROCr) stop enumerating at the first invalid entry (e.g. -1).
        if not part or part.startswith("-"):
            break
        out.append(part)
    return out


def parse_smi(output: str) -> list[DeviceMemory]:
    devices = []
    for line in output.strip().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 4:
            raise ValueError(f"unexpected nvidia-smi line: {line!r}")
        index, uuid, free, total = fields
        devices.append(DeviceMemory(int(index), uuid, int(free) * _MIB, int(total) * _MIB))
    return devices


class _Gpu(Protocol):
    @property
    def index(self) -> int: ...
    @property
    def uuid(self) -> str: ...


GpuT = TypeVar("GpuT", bound=_Gpu)


def select_visible(devices: list[GpuT], wanted: list[str] | None) -> list[GpuT]:
    """The devices a CUDA_VISIBLE_DEVICES list (``visible_devices``) leaves, in its order."""
    if wanted is None:
        return devices
    chosen = []
    for entry in wanted:
        match = [d for d in devices if str(d.index) == entry or d.uuid.startswith(entry)]
        if not match:
            break  # CUDA ignores everything after an unknown device
        chosen.append(match[0])
    return chosen


def run_nvidia_smi(query: str = _SMI_QUERY, timeout: float = 10.0) -> str:
    """nvidia-smi's output for a ``--query-gpu=...`` query; raises OSError /
    CalledProcessError (FileNotFoundError when it is not installed)."""
    done = subprocess.run(
        ["nvidia-smi", query, "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )
    return done.stdout


def free_memory(
    environ: Mapping[str, str] | None = None, smi: Callable[[], str] = run_nvidia_smi
) -> MemorySnapshot:
    """Free memory of the visible GPUs, or of system RAM when there is none."""
    environ = os.environ if environ is None else environ
    wanted = visible_devices(environ)
    note: str | None = None
    if wanted == []:
        note = "CUDA_VISIBLE_DEVICES hides every GPU"
    else:
        try:
            devices = select_visible(parse_smi(smi()), wanted)
        except FileNotFoundError:
            note = "nvidia-smi not found"
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            note = f"nvidia-smi failed: {exc}"
        else:
            if devices:
                return MemorySnapshot(
                    kind="gpu",
                    devices=devices,
                    free_bytes=sum(d.free_bytes for d in devices),
                    total_bytes=sum(d.total_bytes for d in devices),
                )
            note = "no visible GPU"
    vm = psutil.virtual_memory()
    return MemorySnapshot(
        kind="ram", free_bytes=int(vm.available), total_bytes=int(vm.total), note=note
    )
