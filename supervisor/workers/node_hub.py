"""A node's own Hub cache, as its node agent checks and removes files in it.

A download job that names a node fills that node's Hub cache
(supervisor/lab/node_exec.py); the parent records the files by their paths
there (supervisor/lab/node_files.py). Before a worker is placed on such a
model the parent asks the node's agent whether the file is still there, and
deleting the model asks it to remove the files. Both take paths from the
parent's records, so both are bounded here, on the node, to the cache:

- the cache is the one a download job on this node writes into: the node's
  ``HF_HUB_CACHE``, else ``HF_HOME``/hub, else ``XDG_CACHE_HOME``/huggingface/hub,
  else ~/.cache/huggingface/hub, read from the same allowlisted
  environment the job gets;
- a path is taken only when it names a file of a repo's snapshot
  (``models--ORG--NAME/snapshots/REV/...``) and the folders leading to it,
  with their symlinks resolved, stay inside the cache; anything else is
  refused, and with one refused path nothing is removed;
- a snapshot's file is a symlink to a blob of its repo: the blob goes too,
  unless another snapshot of the repo still links to it; a link that leads
  out of the repo's blobs is removed, never what it points to.

This module runs on the node (in the agent's process): stdlib only.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Removal:
    """What one node's removal did (its paths as the parent gave them)."""

    removed: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # gone already
    refused: list[str] = field(default_factory=list)  # none removed then
    freed_bytes: int = 0


def hub_cache_dir(environ: Mapping[str, str]) -> Path:
    """The Hub cache huggingface_hub resolves from ``environ`` (its constants' rule)."""
    if environ.get("HF_HUB_CACHE"):
        return Path(environ["HF_HUB_CACHE"]).expanduser().absolute()
    home = environ.get("HF_HOME") or os.path.join(environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser().absolute() / "hub"


def _in_snapshot(cache: Path, raw: str) -> Path | None:
    """``raw`` as a file of a snapshot in ``cache`` (its folders' symlinks
    resolved, the file's own kept), or None when it is no such path."""
    path = Path(raw)
    if not path.is_absolute():
        return None
    root = cache.resolve()
    parent = Path(os.path.normpath(path.parent)).resolve()
    if not parent.is_relative_to(root):
        return None
    parts = parent.relative_to(root).parts
    if len(parts) < 3 or not parts[0].startswith("models--") or parts[1] != "snapshots" or not path.name \
            or path.name in (".", ".."):
        return None
    return parent / path.name


def check_files(cache: Path, paths: list[str]) -> dict[str, list[str]]:
    """Which of ``paths`` are files there (a snapshot link whose blob is gone
    is missing), which are not, and which this cache refuses."""
    found: dict[str, list[str]] = {"present": [], "missing": [], "refused": []}
    for raw in paths:
        path = _in_snapshot(cache, raw)
        if path is None:
            found["refused"].append(raw)
        else:
            found["present" if path.is_file() else "missing"].append(raw)
    return found


def remove_files(cache: Path, paths: list[str]) -> Removal:
    """Remove ``paths`` (snapshot files) and the blobs only they link to;
    ``removed``, ``missing`` (already gone), ``refused`` (then nothing is
    removed) and ``freed_bytes``. A snapshot left empty goes, and a repo
    left with no snapshot goes whole."""
    checked = check_files(cache, paths)
    if checked["refused"]:
        return Removal(refused=checked["refused"])
    done = Removal()
    root = cache.resolve()
    repos: set[Path] = set()
    for raw in paths:
        path = _in_snapshot(cache, raw)
        assert path is not None  # checked above
        repo = root / path.relative_to(root).parts[0]
        repos.add(repo)
        if not path.is_symlink() and not path.exists():
            done.missing.append(raw)
            continue
        done.freed_bytes += _remove_one(path, repo)
        done.removed.append(raw)
    for repo in repos:
        _prune(repo)
    return done


def _remove_one(path: Path, repo: Path) -> int:
    """Unlink one snapshot file, and its blob when nothing else links to it; the bytes freed."""
    if not path.is_symlink():
        size = path.stat().st_size
        path.unlink()
        return size
    target = Path(os.path.realpath(path))
    path.unlink()
    blobs = (repo / "blobs").resolve()
    if target.parent != blobs or not target.is_file() or _linked(repo / "snapshots", target):
        return 0  # out of the repo's blobs, gone already, or another revision's too
    size = target.stat().st_size
    target.unlink()
    return size


def _linked(snapshots: Path, blob: Path) -> bool:
    """Whether a snapshot link of the repo still leads to ``blob``."""
    for folder, dirs, files in os.walk(snapshots):
        for name in (*files, *dirs):
            link = Path(folder) / name
            if link.is_symlink() and Path(os.path.realpath(link)) == blob:
                return True
    return False


def _prune(repo: Path) -> None:
    """Drop the repo's empty snapshot folders, and the repo once no snapshot is left."""
    snapshots = repo / "snapshots"
    if not snapshots.is_dir() or snapshots.is_symlink():
        return
    for folder, _, _ in sorted(os.walk(snapshots), key=lambda w: -len(w[0])):
        if Path(folder) != snapshots and not any(os.scandir(folder)):
            os.rmdir(folder)
    if not any(os.scandir(snapshots)) and not repo.is_symlink():
        # Its refs and blobs served only the snapshots that are gone.
        shutil.rmtree(repo)
