"""The files of a Hugging Face model dir an export reads, kept inside it.

The job's params resolved the model dir inside the roots, but the files in
it are read by name, and a name can be a symbolic link to anywhere (a
config.json linked to another user's file, a shard linked to a device) or,
in a shard index, a path with ``..``. So before an export reads a dir,
every entry of it must resolve inside the dir itself, or, for a snapshot of
the Hugging Face hub cache (``<repo>/snapshots/<revision>``, whose files
are links into ``<repo>/blobs``), inside that repo's blobs.
"""

from __future__ import annotations

import os
from pathlib import Path

from jobs.context import JobError

# A model dir holds tens of files; walking more than this is not a model dir.
MAX_ENTRIES = 10_000


def _allowed(model_dir: Path) -> tuple[Path, ...]:
    real = model_dir.resolve()
    if real.parent.name == "snapshots":
        return real, real.parent.parent / "blobs"
    return (real,)


def _inside(path: Path, allowed: tuple[Path, ...]) -> bool:
    real = path.resolve()
    return any(real.is_relative_to(root) for root in allowed)


def check_model_dir(model_dir: Path) -> None:
    """JobError naming the first entry that leads out of ``model_dir``."""
    allowed = _allowed(model_dir)
    seen = 0
    for dirpath, dirnames, filenames in os.walk(model_dir):
        for name in (*dirnames, *filenames):
            seen += 1
            if seen > MAX_ENTRIES:
                raise JobError(f"{model_dir.name} holds more than {MAX_ENTRIES} entries; not a model dir")
            path = Path(dirpath) / name
            if path.is_symlink() and not _inside(path, allowed):
                raise JobError(f"{path.relative_to(model_dir)} in {model_dir.name} is a link to a place "
                               "outside the model dir; it is not read")
        # Hidden dirs (.cache, .git) are never read by an export.
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]


def model_file(model_dir: Path, name: str, what: str) -> Path:
    """``name`` (as a file of the dir, e.g. an index names a shard) inside ``model_dir``."""
    rel = Path(name)
    if not name or rel.is_absolute() or ".." in rel.parts or "\x00" in name:
        raise JobError(f"{what}: {name!r} is not a file name inside the model dir")
    path = model_dir / rel
    if not _inside(path, _allowed(model_dir)):
        raise JobError(f"{what}: {name!r} leads outside the model dir; it is not read")
    return path
