"""Which GPU device nodes the systemd unit opens: those of the installed builds.

The unit runs with ``DevicePolicy=closed``: only the devices it lists exist
for the service. Which ones follows the GPU kind of the installed builds:

- ``nvidia`` (CUDA): ``/dev/nvidiactl``, ``/dev/nvidia0..N``, ``nvidia-uvm``,
  ``nvidia-caps``;
- ``rocm`` (HIP): ``/dev/kfd`` and the DRM nodes ``/dev/dri/*``;
- ``vulkan``: the DRM nodes, and the NVIDIA nodes for Vulkan on an NVIDIA GPU.

The kind is read from what is installed, without importing it: the engine
wheel's shared libraries name the GPU runtime they were linked against
(``libcudart``/``libcublas``, ``libamdhip64``/``libhipblas``/``librocblas``,
``libvulkan``), and torch's version tag (``+cu128``, ``+rocm6.4``, ``+cpu``)
covers fine-tuning and vLLM. The engine's wheel index (``ENGINE_INDEX``) is
gone after install (pip records no index), and the device nodes present say
nothing of the build (a display GPU has ``/dev/dri`` too; a staging root has
none). With CPU builds only, every kind is allowed, so a GPU build installed
later is not shut out; ``--gpu`` chooses explicitly.
"""

from __future__ import annotations

import mmap
import platform
import re
from collections.abc import Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Literal

GpuKind = Literal["nvidia", "rocm", "vulkan"]
ALL_KINDS: tuple[GpuKind, ...] = ("nvidia", "rocm", "vulkan")

_NVIDIA_RULES = ("char-nvidiactl rw", "char-nvidia-frontend rw", "char-nvidia-uvm rw",
                 "char-nvidia-caps rw")
_KFD_RULE = "/dev/kfd rw"
_DRM_RULE = "char-drm rw"
# Groups that own /dev/kfd and /dev/dri/* on common distributions (0660).
DEVICE_GROUPS = ("render", "video")

# Names of GPU runtime libraries as they appear in a linked library's
# dynamic section (auditwheel keeps the stem when it bundles one).
_MARKERS: dict[bytes, GpuKind] = {
    b"libcudart": "nvidia", b"libcublas": "nvidia",
    b"libamdhip64": "rocm", b"libhipblas": "rocm", b"librocblas": "rocm",
    b"libvulkan": "vulkan",
}
_SCAN_LIMIT = 4 << 30  # bytes of libraries scanned at most (a CUDA wheel is ~1 GiB)
_LIBRARY = re.compile(r"\.so(\.\d+)*$")


def device_rules(kinds: Iterable[GpuKind]) -> list[str]:
    """``DeviceAllow=`` values for these kinds, each node once."""
    wanted = set(kinds)
    rules: list[str] = []
    if wanted & {"nvidia", "vulkan"}:
        rules += _NVIDIA_RULES
    if "rocm" in wanted:
        rules.append(_KFD_RULE)
    if wanted & {"rocm", "vulkan"}:
        rules.append(_DRM_RULE)
    return rules


def device_groups(kinds: Iterable[GpuKind]) -> tuple[str, ...]:
    """Groups the service user needs for the DRM and KFD nodes (NVIDIA's are 0666)."""
    return DEVICE_GROUPS if set(kinds) & {"rocm", "vulkan"} else ()


def parse_kinds(text: str) -> tuple[GpuKind, ...] | None:
    """``--gpu``: ``auto`` (None: detect), ``none``, or a comma list of kinds."""
    value = text.strip().lower()
    if value == "auto":
        return None
    if value == "none":
        return ()
    out: list[GpuKind] = []
    for part in (p.strip() for p in value.split(",")):
        kind = next((k for k in ALL_KINDS if k == part), None)
        if kind is None:
            raise ValueError(f"unknown GPU kind {part!r}: use auto, none or any of {', '.join(ALL_KINDS)}")
        if kind not in out:
            out.append(kind)
    return tuple(out)


def _scan(path: Path, budget: int) -> tuple[set[GpuKind], int]:
    """Kinds named in one library file, and the bytes it took of the budget."""
    try:
        size = path.stat().st_size
        if size == 0 or size > budget:
            return set(), 0
        with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return {kind for marker, kind in _MARKERS.items() if data.find(marker) >= 0}, size
    except OSError:
        return set(), 0  # unreadable or vanished: it names nothing


def _installed(name: str, path: Sequence[str] | None) -> metadata.Distribution | None:
    """The installed distribution (on ``path``, else this interpreter's)."""
    found = (metadata.distributions(name=name, path=list(path)) if path is not None
             else metadata.distributions(name=name))
    return next(iter(found), None)


def engine_kinds(path: Sequence[str] | None = None) -> set[GpuKind] | None:
    """GPU kinds the installed engine wheel links; None when it is not installed."""
    dist = _installed("xllamacpp", path)
    if dist is None:
        return None
    kinds: set[GpuKind] = set()
    budget = _SCAN_LIMIT
    for entry in dist.files or []:
        if not _LIBRARY.search(entry.name):
            continue
        found, used = _scan(Path(str(dist.locate_file(entry))), budget)
        kinds |= found
        budget -= used
    return kinds


def torch_kinds(path: Sequence[str] | None = None) -> set[GpuKind] | None:
    """The GPU kind of the installed torch build; None when torch is not installed."""
    dist = _installed("torch", path)
    if dist is None:
        return None
    _, _, local = dist.version.partition("+")
    if local.startswith("cu"):
        return {"nvidia"}
    if local.startswith("rocm"):
        return {"rocm"}
    if local:
        return set()  # +cpu, +xpu: no device here needs a rule
    # PyPI's own Linux x86_64 wheels are the CUDA build.
    return {"nvidia"} if platform.machine() == "x86_64" else set()


def detect(path: Sequence[str] | None = None) -> tuple[tuple[GpuKind, ...], str]:
    """The kinds the unit allows, and one line saying why."""
    engine, torch = engine_kinds(path), torch_kinds(path)
    found = (engine or set()) | (torch or set())

    def said(name: str, kinds: set[GpuKind] | None) -> str:
        if kinds is None:
            return f"{name}: not installed"
        return f"{name}: {', '.join(sorted(kinds)) or 'CPU'} build"

    why = f"{said('engine', engine)}; {said('torch', torch)}"
    if not found:
        return ALL_KINDS, (f"{why}: no GPU build installed, so the unit allows every GPU kind "
                           "(run install-systemd again after installing one, or pass --gpu)")
    kinds = tuple(k for k in ALL_KINDS if k in found)
    return kinds, f"{why}: the unit allows {', '.join(kinds)} devices"
