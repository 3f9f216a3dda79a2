"""Models held in a cluster node's own Hub cache, recorded in the parent's SQLite.

A download job that names a node (``"node": "node-a"``) runs there and
writes into that node's local Hub cache (its HF_HOME there), not the
parent's shared one (supervisor/lab/node_exec.py). The parent cannot scan
that disk, so when such a job succeeds it records here which node holds
which files, and the GGUF header of the model's first file as the node's
agent read it there (placement sizes the model from it). The record
outlives the job row (jobs are pruned) and the node (a node that is gone
may come back with its disk).

The library lists each recorded model with the nodes that hold it
(:func:`node_entries`, handed to ModelLibrary.set_node_models), and the
pool places its worker only on a live node among them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from supervisor.db import Database
from supervisor.models.entry import ModelEntry
from supervisor.models.gguf_info import GgufInfo

log = logging.getLogger(__name__)

class HeldModel(msgspec.Struct, frozen=True, kw_only=True):
    """One model's first file on one node, as recorded."""

    model_id: str
    node: str
    path: str  # on that node
    size_bytes: int  # the model's files there together
    repo_id: str
    revision: str
    info: GgufInfo | None
    recorded_at: float
    # The vision projector its repo's revision left on that node, if any.
    mmproj: str | None = None


class NodeFiles:
    """Reads and writes of the node_files table."""

    def __init__(self, db: Database, clock: Callable[[], float] = time.time) -> None:
        self.db = db
        self.clock = clock

    async def record_download(self, node: str, job_id: str, result: dict[str, Any], header: bytes | None) -> int:
        """Record a download job's files on ``node`` (its result's ``files``);
        the model's first file gets its id and ``header`` (GgufInfo, msgpack).
        The rows written."""
        files = [f for f in result.get("files") or [] if isinstance(f, dict)]
        model_id = result.get("model_id")
        model_file = _model_file(files) if model_id else None
        rows = [(node, str(f["local_path"]), model_id if f is model_file else None, str(result["repo_id"]),
                 str(result.get("commit") or result.get("revision") or ""), str(f["path"]), int(f["size"]),
                 header if f is model_file else None, job_id, self.clock()) for f in files]
        async with self.db.write() as conn:
            # A file downloaded again (a newer job) replaces its row.
            await conn.executemany("INSERT OR REPLACE INTO node_files VALUES (?,?,?,?,?,?,?,?,?,?)", rows)
        return len(rows)

    async def held_models(self) -> list[HeldModel]:
        """Every recorded model on every node, oldest record first."""
        # The projector is matched by repo and revision, not by job: a later
        # download of another quant of the repo fetches it again, and its row
        # then names that job.
        rows = await self.db.reader.execute_fetchall(
            "SELECT f.model_id, f.node, f.local_path, f.repo_id, f.revision, f.header, f.recorded_at, "
            "(SELECT SUM(size) FROM node_files g WHERE g.node = f.node AND g.repo_id = f.repo_id "
            " AND g.revision = f.revision AND g.job_id = f.job_id), "
            "(SELECT m.local_path FROM node_files m WHERE m.node = f.node AND m.repo_id = f.repo_id "
            " AND m.revision = f.revision AND m.model_id IS NULL AND m.repo_path LIKE '%.gguf' "
            " AND (m.repo_path LIKE 'mmproj%' OR m.repo_path LIKE '%/mmproj%') ORDER BY m.repo_path LIMIT 1) "
            "FROM node_files f WHERE f.model_id IS NOT NULL ORDER BY f.recorded_at, f.node")
        held = []
        for model_id, node, path, repo_id, revision, header, recorded_at, size, mmproj in rows:
            info = None
            if header is not None:
                try:
                    info = msgspec.msgpack.decode(header, type=GgufInfo)
                except msgspec.ValidationError as exc:
                    # Written by another version: listed, and sized as a file of unknown shape.
                    log.warning("node %s: the recorded header of %s no longer reads: %s", node, model_id, exc)
            held.append(HeldModel(model_id=model_id, node=node, path=path, size_bytes=int(size or 0),
                                  repo_id=repo_id, revision=revision, info=info, recorded_at=recorded_at,
                                  mmproj=mmproj))
        return held

    async def model_files(self, model_id: str) -> dict[str, list[str]]:
        """Each node that holds the model -> the paths there of its files: its
        own GGUFs (its first file and shards, from its download), and the
        files of its repo's revision that are no model (its projector, the
        README) unless another model of that revision is recorded there too
        (it needs the projector)."""
        models = await self.db.reader.execute_fetchall(
            "SELECT node, job_id, repo_id, revision FROM node_files WHERE model_id = ? ORDER BY node", (model_id,))
        held: dict[str, list[str]] = {}
        for node, job_id, repo_id, revision in models:
            rows = await self.db.reader.execute_fetchall(
                "SELECT local_path, repo_path, job_id, model_id FROM node_files "
                "WHERE node = ? AND repo_id = ? AND revision = ?", (node, repo_id, revision))
            shared = any(other is not None and other != model_id for *_, other in rows)
            held[node] = sorted(path for path, repo_path, job, _ in rows
                                if (job == job_id if is_model_file({"path": repo_path}) else not shared))
        return held

    async def drop(self, node: str, paths: list[str]) -> int:
        """Forget these files on ``node`` (model_files' paths); the rows dropped."""
        async with self.db.write() as conn:
            cursor = await conn.executemany("DELETE FROM node_files WHERE node = ? AND local_path = ?",
                                            [(node, path) for path in paths])
            return cursor.rowcount


def is_model_file(f: dict[str, Any]) -> bool:
    """A GGUF that is not a vision projector."""
    name = Path(str(f.get("path", ""))).name
    return name.endswith(".gguf") and not name.startswith("mmproj")


def _model_file(files: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The file a worker loads: the first model GGUF (the download job lists
    the model's files, its first shard first)."""
    return next((f for f in files if is_model_file(f)), None)


def node_entries(held: Sequence[HeldModel]) -> list[ModelEntry]:
    """The library's entries for models held on nodes: one per model id,
    ``nodes`` mapping each node that holds it to its path there."""
    by_id: dict[str, list[HeldModel]] = {}
    for h in held:
        by_id.setdefault(h.model_id, []).append(h)
    entries = []
    for model_id, copies in by_id.items():
        last = copies[-1]  # the newest record speaks for the model's facts
        usable = last.info is not None
        entries.append(ModelEntry(
            id=model_id, path=last.path, files=[last.path], size_bytes=last.size_bytes, source="node",
            root="", mtime=last.recorded_at, repo_id=last.repo_id, revision=last.revision,
            info=last.info, quantization=last.info.quantization if last.info is not None else None,
            usable=usable, reason=None if usable else "its header could not be read on its node",
            nodes={h.node: h.path for h in copies},
            # Linked as the download fetched it with the model; the parent cannot read it to check the fit.
            mmproj=last.mmproj,
            projector_note=None if last.mmproj is None else "linked by its download on the node, unchecked",
            node_mmproj={h.node: h.mmproj for h in copies if h.mmproj is not None}))
    return entries
