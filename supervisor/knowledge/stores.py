"""Vector stores and their files: records, and the objects the SDK reads.

A store records the embedding model it was made with, so its chunks and its
queries are always embedded by the same model, even after the setting
changes. A store's status and counts are derived from its files' rows.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from supervisor.db import Database
from supervisor.errors import NotFound
from supervisor.knowledge.chunking import ChunkSize
from supervisor.knowledge.records import SCOPED, STORE_PREFIX, PageAsk, new_id, page_sql, scope_args

FileStatus = Literal["in_progress", "completed", "cancelled", "failed"]
Attributes = dict[str, str | float | bool]


@dataclass(frozen=True)
class StoreRecord:
    id: str
    owner: str | None
    name: str
    created_at: int
    last_active_at: int
    metadata: dict[str, str]
    model: str


@dataclass(frozen=True)
class StoreFile:
    store_id: str
    file_id: str
    created_at: int
    status: FileStatus
    last_error: dict[str, str] | None
    usage_bytes: int
    size: ChunkSize
    attributes: Attributes

    def to_object(self) -> dict[str, Any]:
        """The SDK's ``VectorStoreFile``."""
        return {"id": self.file_id, "object": "vector_store.file", "created_at": self.created_at,
                "vector_store_id": self.store_id, "status": self.status, "last_error": self.last_error,
                "usage_bytes": self.usage_bytes, "chunking_strategy": self.size.to_object(),
                "attributes": self.attributes}


def _store(row: Any) -> StoreRecord:
    return StoreRecord(row["id"], row["owner"], row["name"], int(row["created_at"]), int(row["last_active_at"]),
                       json.loads(row["metadata"]), row["model"])


def _store_file(row: Any) -> StoreFile:
    return StoreFile(row["store_id"], row["file_id"], int(row["created_at"]), row["status"],
                     json.loads(row["last_error"]) if row["last_error"] else None, int(row["usage_bytes"]),
                     ChunkSize(int(row["chunk_tokens"]), int(row["overlap_tokens"])), json.loads(row["attributes"]))


class StoreBook:
    """The rows of vector stores and of the files in them."""

    def __init__(self, db: Database, clock: Callable[[], float] = time.time) -> None:
        self.db = db
        self.clock = clock

    async def create(self, owner: str | None, name: str, metadata: dict[str, str], model: str) -> StoreRecord:
        now = int(self.clock())
        rec = StoreRecord(new_id(STORE_PREFIX), owner, name, now, now, metadata, model)
        async with self.db.write() as conn:
            await conn.execute("INSERT INTO vector_stores (id, owner, name, created_at, last_active_at, metadata, model)"
                               " VALUES (?, ?, ?, ?, ?, ?, ?)",
                               (rec.id, owner, name, now, now, json.dumps(metadata), model))
        return rec

    async def get(self, store_id: str, scope: str | None) -> StoreRecord:
        async with self.db.reader.execute("SELECT * FROM vector_stores WHERE id = ?" + SCOPED,
                                          (store_id, *scope_args(scope))) as cur:
            row = await cur.fetchone()
        if row is None:
            raise NotFound(f"no vector store with id {store_id!r}", param="vector_store_id")
        return _store(row)

    async def page(self, scope: str | None, ask: PageAsk) -> list[StoreRecord]:
        sql, args = "SELECT * FROM vector_stores WHERE 1" + SCOPED, list[object](scope_args(scope))
        cursor, order = page_sql(ask, "vector_stores")
        if ask.after is not None:
            await self.get(ask.after, scope)
            sql, args = sql + cursor, [*args, ask.after]
        async with self.db.reader.execute(sql + order, (*args, ask.limit + 1)) as cur:
            return [_store(r) for r in await cur.fetchall()]

    async def touch(self, store_id: str) -> None:
        async with self.db.write() as conn:
            await conn.execute("UPDATE vector_stores SET last_active_at = ? WHERE id = ?",
                               (int(self.clock()), store_id))

    async def remove(self, store_id: str) -> None:
        """The store and its file rows (cascade); its chunks are removed first by the caller."""
        async with self.db.write() as conn:
            await conn.execute("DELETE FROM vector_stores WHERE id = ?", (store_id,))

    async def to_object(self, rec: StoreRecord) -> dict[str, Any]:
        """The SDK's ``VectorStore``, with counts and bytes from its files."""
        counts = {"in_progress": 0, "completed": 0, "cancelled": 0, "failed": 0}
        usage = 0
        async with self.db.reader.execute(
                "SELECT status, count(*), sum(usage_bytes) FROM vector_store_files WHERE store_id = ?"
                " GROUP BY status", (rec.id,)) as cur:
            for status, n, used in await cur.fetchall():
                counts[status] = int(n)
                usage += int(used or 0)
        return {"id": rec.id, "object": "vector_store", "created_at": rec.created_at, "name": rec.name,
                "usage_bytes": usage, "file_counts": {**counts, "total": sum(counts.values())},
                "status": "in_progress" if counts["in_progress"] else "completed",
                "last_active_at": rec.last_active_at, "metadata": rec.metadata,
                "expires_after": None, "expires_at": None}

    # ------------------------------------------------------------ files in stores

    async def add_file(self, store_id: str, file_id: str, size: ChunkSize, attributes: Attributes) -> StoreFile:
        """Add (or restart) a file's row as in_progress."""
        row = StoreFile(store_id, file_id, int(self.clock()), "in_progress", None, 0, size, attributes)
        async with self.db.write() as conn:
            await conn.execute(
                "INSERT OR REPLACE INTO vector_store_files (store_id, file_id, created_at, status, last_error,"
                " usage_bytes, chunk_tokens, overlap_tokens, attributes) VALUES (?, ?, ?, ?, NULL, 0, ?, ?, ?)",
                (store_id, file_id, row.created_at, row.status, size.max_tokens, size.overlap_tokens,
                 json.dumps(attributes)))
        return row

    async def get_file(self, store_id: str, file_id: str) -> StoreFile:
        async with self.db.reader.execute("SELECT * FROM vector_store_files WHERE store_id = ? AND file_id = ?",
                                          (store_id, file_id)) as cur:
            row = await cur.fetchone()
        if row is None:
            raise NotFound(f"no file {file_id!r} in vector store {store_id!r}", param="file_id")
        return _store_file(row)

    async def files_page(self, store_id: str, ask: PageAsk, status: FileStatus | None) -> list[StoreFile]:
        sql, args = "SELECT * FROM vector_store_files WHERE store_id = ?", list[object]([store_id])
        if status is not None:
            sql, args = sql + " AND status = ?", [*args, status]
        cursor, order = page_sql(ask, "vector_store_files", "store_id = ? AND file_id = ?")
        if ask.after is not None:
            await self.get_file(store_id, ask.after)
            sql, args = sql + cursor, [*args, store_id, ask.after]
        async with self.db.reader.execute(sql + order, (*args, ask.limit + 1)) as cur:
            return [_store_file(r) for r in await cur.fetchall()]

    async def completed_files(self, store_id: str) -> list[StoreFile]:
        async with self.db.reader.execute("SELECT * FROM vector_store_files WHERE store_id = ? AND status = 'completed'",
                                          (store_id,)) as cur:
            return [_store_file(r) for r in await cur.fetchall()]

    async def files_in_progress(self) -> list[StoreFile]:
        async with self.db.reader.execute("SELECT * FROM vector_store_files WHERE status = 'in_progress'") as cur:
            return [_store_file(r) for r in await cur.fetchall()]

    async def stores_of_file(self, file_id: str) -> list[str]:
        async with self.db.reader.execute("SELECT store_id FROM vector_store_files WHERE file_id = ?",
                                          (file_id,)) as cur:
            return [r[0] for r in await cur.fetchall()]

    async def finish_file(self, store_id: str, file_id: str, status: FileStatus, usage_bytes: int = 0,
                          error: dict[str, str] | None = None) -> None:
        async with self.db.write() as conn:
            await conn.execute("UPDATE vector_store_files SET status = ?, usage_bytes = ?, last_error = ?"
                               " WHERE store_id = ? AND file_id = ?",
                               (status, usage_bytes, json.dumps(error) if error else None, store_id, file_id))

    async def remove_file(self, store_id: str, file_id: str) -> None:
        async with self.db.write() as conn:
            await conn.execute("DELETE FROM vector_store_files WHERE store_id = ? AND file_id = ?",
                               (store_id, file_id))
