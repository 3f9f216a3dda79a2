"""AMD GPU readings: ``amd-smi``, else ``rocm-smi``, else the amdgpu driver's sysfs.

Each gives the same :class:`~supervisor.models.devices.GpuReading` list as the
nvidia-smi reader. ``amd-smi`` (ROCm 6 and later) answers
``metric --mem-usage --json`` with a list of ``{"gpu": N, "mem_usage":
{"total_vram": {"value": V, "unit": "MB"}, ...}}`` (newer releases wrap the
list as ``{"gpu_data": [...]}``); its names come from ``static --asic --json``.
``rocm-smi --showmeminfo vram --json`` answers ``{"card0": {"VRAM Total
Memory (B)": "...", "VRAM Total Used Memory (B)": "..."}}``, strings in
bytes. Without either tool (a Vulkan build on Mesa's driver needs no ROCm),
``/sys/class/drm/card*/device/mem_info_vram_{total,used}`` of amdgpu cards.

A GPU's index is amd-smi's ``gpu`` or rocm-smi's ``cardN``: the ordinal that
``ROCR_VISIBLE_DEVICES`` selects. Odd output (no JSON, a GPU without its
memory fields, negative or non-numeric amounts) is a
:class:`~supervisor.models.devices.DeviceReadError` naming what is missing;
missing names only fall back to a plain one.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from supervisor.models.gpu_reading import MIB, DeviceReadError, GpuReading
from supervisor.models.memory import select_visible, visible_devices
from supervisor.models.smi_run import run_tool

AMD_SMI_MEMORY = ("amd-smi", "metric", "--mem-usage", "--json")
AMD_SMI_STATIC = ("amd-smi", "static", "--asic", "--json")
ROCM_SMI = ("rocm-smi", "--showmeminfo", "vram", "--showproductname", "--showuniqueid", "--json")
SYSFS_DRM = Path("/sys/class/drm")
AMD_VENDOR_ID = "0x1002"
TIMEOUT_S = 10.0

# amd-smi's "MB" are MiB (it divides bytes by 1024 * 1024).
_UNITS = {"B": 1, "KB": 1024, "KIB": 1024, "MB": MIB, "MIB": MIB, "GB": 1024 * MIB, "GIB": 1024 * MIB}
_ROCM_TOTAL = "VRAM Total Memory (B)"
_ROCM_USED = "VRAM Total Used Memory (B)"
_ROCM_NAMES = ("Card Series", "Card series", "Device Name", "Card Model", "Card model")
_CARD = re.compile(r"card(\d+)")
_NAME_MAX = 128

Runner = Callable[[Sequence[str], float], str]


def _decode(tool: str, text: str) -> Any:
    """The JSON document in ``text``; a tool may print warning lines before it."""
    try:
        return json.loads(text)
    except ValueError:
        pass  # retried below from the first line that opens a JSON document
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.lstrip().startswith(("{", "[")):
            try:
                return json.loads("\n".join(lines[i:]))
            except ValueError:
                break
    raise DeviceReadError(f"{tool} printed no JSON: {text.strip()[:80]!r}")


def _clean_name(raw: object, fallback: str) -> str:
    if not isinstance(raw, str):
        return fallback
    name = "".join(c for c in raw if c.isprintable()).strip()[:_NAME_MAX]
    return name if name and name.upper() != "N/A" else fallback


def _amount(field: object) -> int | None:
    """Bytes in an amd-smi ``{"value": V, "unit": U}`` (or a bare number of MiB)."""
    unit = "MB"
    value: object = field
    if isinstance(field, dict):
        value, unit = field.get("value"), str(field.get("unit", "MB"))
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    scale = _UNITS.get(unit.strip().upper())
    if scale is None or not math.isfinite(number) or number < 0:
        return None
    return int(number * scale)


def _entries(tool: str, doc: Any) -> list[dict[str, Any]]:
    """amd-smi's per-GPU objects, from a bare list or a ``gpu_data`` wrapper."""
    if isinstance(doc, dict):
        doc = doc.get("gpu_data", [])
    if not isinstance(doc, list):
        raise DeviceReadError(f"{tool}: expected a list of GPUs, got {type(doc).__name__}")
    out = []
    for entry in doc:
        gpu = entry.get("gpu") if isinstance(entry, dict) else None
        if isinstance(gpu, int) and not isinstance(gpu, bool) and gpu >= 0:
            out.append(entry)
    return out


def parse_amd_smi(memory_text: str, static_text: str | None = None) -> list[GpuReading]:
    """Readings from ``amd-smi metric --mem-usage --json`` (names from ``static``)."""
    names: dict[int, tuple[str, str]] = {}
    if static_text:
        try:
            for entry in _entries("amd-smi static", _decode("amd-smi static", static_text)):
                raw = entry.get("asic")
                asic: dict[str, Any] = raw if isinstance(raw, dict) else {}
                serial = _clean_name(asic.get("asic_serial"), "")
                names[entry["gpu"]] = (_clean_name(asic.get("market_name"), ""), serial)
        except DeviceReadError:
            names = {}  # names are a nicety: the memory below is the reading
    out = []
    for entry in _entries("amd-smi", _decode("amd-smi", memory_text)):
        index = entry["gpu"]
        mem = entry.get("mem_usage")
        mem = mem if isinstance(mem, dict) else {}
        total = _amount(mem.get("total_vram"))
        free = _amount(mem.get("free_vram"))
        used = _amount(mem.get("used_vram"))
        if free is None and total is not None and used is not None:
            free = max(0, total - used)
        if total is None or free is None:
            raise DeviceReadError(f"amd-smi gave no VRAM total/free for GPU {index}")
        name, serial = names.get(index, ("", ""))
        out.append(GpuReading(index=index, uuid=_uuid(serial, index), name=name or f"AMD GPU {index}",
                              free_bytes=min(free, total), total_bytes=total))
    return sorted(out, key=lambda r: r.index)


def _uuid(unique_id: str, index: int) -> str:
    # ROCR_VISIBLE_DEVICES takes "GPU-<unique id in hex>" as well as an index.
    hexpart = unique_id[2:] if unique_id.lower().startswith("0x") else unique_id
    if hexpart and all(c in "0123456789abcdefABCDEF" for c in hexpart):
        return f"GPU-{hexpart.lower()}"
    return f"AMD-GPU-{index}"


def _bytes(card: Mapping[str, Any], key: str) -> int | None:
    raw = card.get(key)
    if isinstance(raw, bool) or not isinstance(raw, (int, str)):
        return None
    text = str(raw).strip()
    return int(text) if text.isdigit() else None


def parse_rocm_smi(text: str) -> list[GpuReading]:
    """Readings from ``rocm-smi --showmeminfo vram [--showproductname] --json``."""
    doc = _decode("rocm-smi", text)
    if not isinstance(doc, dict):
        raise DeviceReadError(f"rocm-smi: expected an object of cards, got {type(doc).__name__}")
    out = []
    for key, card in doc.items():
        match = _CARD.fullmatch(key)
        if match is None or not isinstance(card, dict):
            continue  # "system" and other non-card entries
        index = int(match.group(1))
        total, used = _bytes(card, _ROCM_TOTAL), _bytes(card, _ROCM_USED)
        if total is None or used is None:
            raise DeviceReadError(f"rocm-smi gave no VRAM total/used for {key}")
        name = next((_clean_name(card.get(k), "") for k in _ROCM_NAMES if _clean_name(card.get(k), "")), "")
        out.append(GpuReading(index=index, uuid=_uuid(_clean_name(card.get("Unique ID"), ""), index),
                              name=name or f"AMD GPU {index}", free_bytes=max(0, total - used),
                              total_bytes=total))
    return sorted(out, key=lambda r: r.index)


def read_sysfs(drm: Path = SYSFS_DRM) -> list[GpuReading]:
    """amdgpu cards' VRAM as the driver's sysfs shows it, numbered in card order."""
    cards = []
    for path in drm.glob("card*"):
        match = _CARD.fullmatch(path.name)
        if match is None:
            continue  # card0-DP-1 and other connectors
        dev = path / "device"
        try:
            if (dev / "vendor").read_text().strip() != AMD_VENDOR_ID:
                continue
            total = int((dev / "mem_info_vram_total").read_text())
            used = int((dev / "mem_info_vram_used").read_text())
        except FileNotFoundError:
            continue  # not a GPU with its own memory (a display-only card)
        except (OSError, ValueError) as exc:
            raise DeviceReadError(f"cannot read {dev}: {exc}") from exc
        cards.append((int(match.group(1)), dev, total, used))
    out = []
    for index, (card, dev, total, used) in enumerate(sorted(cards)):
        try:
            unique = (dev / "unique_id").read_text().strip()
        except OSError:
            unique = ""  # older kernels and consumer cards have none
        out.append(GpuReading(index=index, uuid=_uuid(unique, index), name=f"AMD GPU (card{card})",
                              free_bytes=max(0, total - used), total_bytes=total))
    return out


class AmdSource:
    """AMD readings through the first of amd-smi, rocm-smi, sysfs that answers.

    No tool and no amdgpu card reads as no GPU. A tool that is installed but
    fails (exit status, hang, nonsense) is passed over for the next; when
    none answers, the first failure is raised. amd-smi's static names are
    read once. The parent's own ``ROCR_VISIBLE_DEVICES`` limits the GPUs, as
    ``CUDA_VISIBLE_DEVICES`` does on NVIDIA.
    """

    def __init__(self, run: Runner = run_tool, drm: Path = SYSFS_DRM, timeout: float = TIMEOUT_S,
                 environ: Mapping[str, str] | None = None) -> None:
        self._run = run
        self._drm = drm
        self._timeout = timeout
        self._wanted = visible_devices(os.environ if environ is None else environ, "ROCR_VISIBLE_DEVICES")
        self._static: str | None = None

    def read(self) -> list[GpuReading]:
        return select_visible(self._read_all(), self._wanted)

    def _read_all(self) -> list[GpuReading]:
        failures: list[str] = []
        for tool, reader in (("amd-smi", self._amd_smi), ("rocm-smi", self._rocm_smi)):
            try:
                return reader()
            except FileNotFoundError:
                continue  # not installed: try the next
            except subprocess.TimeoutExpired:
                failures.append(f"{tool} did not answer within {self._timeout:g} s")
            except (OSError, subprocess.SubprocessError, DeviceReadError) as exc:
                failures.append(f"{tool} failed: {exc}")
        found = read_sysfs(self._drm)
        if found or not failures:
            return found
        raise DeviceReadError("; ".join(failures))

    def _amd_smi(self) -> list[GpuReading]:
        memory = self._run(AMD_SMI_MEMORY, self._timeout)
        if self._static is None:
            try:
                self._static = self._run(AMD_SMI_STATIC, self._timeout)
            except (OSError, subprocess.SubprocessError):
                self._static = ""  # plain names; not worth a retry per reading
        return parse_amd_smi(memory, self._static)

    def _rocm_smi(self) -> list[GpuReading]:
        return parse_rocm_smi(self._run(ROCM_SMI, self._timeout))
