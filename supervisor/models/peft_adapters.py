"""PEFT LoRA adapter dirs in the model dirs, linked to the ``hf`` base they name.

A dir holding ``adapter_config.json`` and ``adapter_model.safetensors`` (what
PEFT's ``save_pretrained`` and the finetune job write) is no model of its own
(supervisor/models/hf_scan.py skips it): it is listed as an adapter and
served on its base by vLLM's per-request LoRA, under ``<base id>:<adapter
id>`` as a GGUF adapter is (supervisor/models/adapters.py). Its base is the
``hf`` model its ``base_model_name_or_path`` names (the base's dir, its id or
its dir's name), or the ``hf`` model whose dir holds the adapter dir. A GGUF
model is never its base: llama.cpp loads GGUF adapters only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from supervisor.models.adapters import AdapterEntry, AdapterLink, pair_id
from supervisor.models.entry import ModelEntry

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# adapter_config.json is small; a larger one is no PEFT config.
_MAX_CONFIG_BYTES = 1 << 20
Settled = Callable[[str, os.stat_result], bool]


def adapter_dirs(root: Path) -> Iterator[Path]:
    """Every PEFT adapter dir under ``root`` (hidden names and symlinked dirs not followed)."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        if CONFIG in filenames and WEIGHTS in filenames:
            dirnames[:] = []
            yield Path(dirpath)


def output_adapter_dirs(root: Path) -> Iterator[tuple[str, Path]]:
    """The adapters fine-tune jobs wrote under an outputs dir, as (id, dir):
    ``<root>/<output>/adapter`` is ``<output>``, served on its hf base as
    ``<base>:<output>`` with no export. Not ``<output>-lora``: that is the
    name the job page's "Try it" gives its GGUF export, which it looks for.
    The checkpoints beside it are not listed: they are steps, not results."""
    try:
        runs = sorted(p for p in root.iterdir() if not p.name.startswith(".") and not p.is_symlink())
    except OSError:
        return
    for run in runs:
        adapter = run / "adapter"
        if not adapter.is_symlink() and (adapter / CONFIG).is_file() and (adapter / WEIGHTS).is_file():
            yield run.name, adapter


def base_ref(config_path: Path) -> str:
    """What the adapter names as its base (``base_model_name_or_path``); "" if nothing.
    Raises OSError or ValueError for a config that cannot be read."""
    if config_path.stat().st_size > _MAX_CONFIG_BYTES:
        raise ValueError(f"{CONFIG} is over {_MAX_CONFIG_BYTES} bytes")
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if not isinstance(config, dict):
        raise ValueError(f"{CONFIG} is not a JSON object")
    ref = config.get("base_model_name_or_path")
    return ref if isinstance(ref, str) else ""


def find_base(ref: str, adapter_dir: Path, bases: Iterable[ModelEntry]) -> ModelEntry | None:
    """The ``hf`` model ``ref`` names, else the one whose dir holds ``adapter_dir``."""
    hf = [b for b in bases if b.kind == "hf"]
    if ref:
        target = Path(ref) if Path(ref).is_absolute() else adapter_dir / ref
        for base in hf:
            if target.exists() and Path(base.path).resolve() == target.resolve():
                return base
        for base in hf:
            if ref in (base.id, base.repo_id) or Path(ref.rstrip("/")).name == Path(base.path).name:
                return base
    for base in hf:
        if Path(base.path) in adapter_dir.parents:
            return base
    return None


def scan(roots: Iterable[Path], bases: dict[str, ModelEntry], settled: Settled,
         pending: set[str], seen: set[str], outputs: Iterable[Path] = ()) -> dict[str, AdapterEntry]:
    """The settled PEFT adapters of every root and of the fine-tunes in
    ``outputs`` (:func:`output_adapter_dirs`), each linked to its base (or
    listed with the reason it has none)."""
    found: list[tuple[str, Path]] = []
    for root in roots:
        if root.is_dir():
            for adapter_dir in adapter_dirs(root):
                rel = adapter_dir.relative_to(root).as_posix()
                found.append((adapter_dir.name if rel == "." else rel, adapter_dir))
    for root in outputs:
        found.extend(output_adapter_dirs(root))
    out: dict[str, AdapterEntry] = {}
    for adapter_id, adapter_dir in found:
        entry = _adapter(adapter_id, adapter_dir, bases, settled, pending, seen)
        if entry is not None and entry.id not in out:
            out[entry.id] = entry
    return out


def _adapter(adapter_id: str, adapter_dir: Path, bases: dict[str, ModelEntry], settled: Settled,
             pending: set[str], seen: set[str]) -> AdapterEntry | None:
    files = [adapter_dir / CONFIG, adapter_dir / WEIGHTS]
    try:
        stats = [f.stat() for f in files]
    except OSError:
        return None  # removed while we looked: the watcher rescans
    seen.update(str(f) for f in files)
    waiting = [str(f) for f, st in zip(files, stats, strict=True) if not settled(str(f), st)]
    if waiting:
        pending.update(waiting)
        return None
    links: list[AdapterLink] = []
    reason: str | None = None
    try:
        base = find_base(base_ref(files[0]), adapter_dir, bases.values())
    except (OSError, ValueError) as exc:
        base, reason = None, f"cannot read {CONFIG}: {exc}"
    if base is not None:
        links = [AdapterLink(base=base.id, id=pair_id(base.id, adapter_id), fits=True)]
    elif reason is None:
        reason = "its base model (base_model_name_or_path) is no Hugging Face model of the library"
    return AdapterEntry(id=adapter_id, path=str(adapter_dir), size_bytes=stats[1].st_size,
                        mtime=max(st.st_mtime for st in stats), links=links,
                        usable=reason is None, reason=reason)
