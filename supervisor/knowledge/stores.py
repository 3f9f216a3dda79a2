"""Vector stores and their files: records, and the objects the SDK reads.

A store records the embedding model it was made with, so its chunks and its
queries are always embedded by the same model, even after the setting
changes. A store's status and counts are derived from its files' rows.

A store made with ``expires_after: {"anchor": "last_active_at", "days": N}``
expires N days after it was last used (made, searched, given a file): it
is then listed as ``expired``, refuses searches and files
(:class:`StoreExpired`), and the knowledge base's sweep deletes it.

A key's stores hold at most ``vector_stores_max_bytes_per_key`` bytes of
files together, each file counted once per store it is in (each store
indexes it apart); an add past it is a 413 naming the setting
(:class:`QuotaExceeded`). Checked in the add's own write transaction, so
two adds at once cannot both slip under it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import aiosqlite

from supervisor.db import Database
from supervisor.errors import BadRequest, NotFound, PayloadTooLarge
from supervisor.knowledge.chunking import ChunkSize
from supervisor.knowledge.records import (
    SCOPED,
    STORE_PREFIX,
    PageAsk,
    new_id,
    page_sql,
    scope_args,
)

FileStatus = Literal["in_progress", "completed", "cancelled", "failed"]
Attributes = dict[str, str | float | bool]
DAY_S = 86400
QUOTA_SETTING = "vector_stores_max_bytes_per_key"
# The bytes of files an owner's stores hold, less one (store, file) row:
# rows in progress or completed (a failed or cancelled one holds nothing).
_USED_SQL = ("SELECT coalesce(sum(f.bytes), 0) FROM vector_store_files v JOIN vector_stores s ON s.id = v.store_id"
             " JOIN files f ON f.id = v.file_id WHERE s.owner = ? AND v.status IN ('in_progress', 'completed')"
             " AND NOT (v.store_id = ? AND v.file_id = ?)")


class StoreExpired(BadRequest):
    code = "vector_store_expired"


class QuotaExceeded(PayloadTooLarge):
    code = "quota_exceeded"


@dataclass(frozen=True)
class StoreRecord:
    id: str
    owner: str | None
    name: str
    created_at: int
    last_active_at: int
    metadata: dict[str, str]
    model: str
    # expires_after's days (anchor last_active_at); None: kept until deleted.
    expires_days: int | None = None

    @property
    def expires_at(self) -> int | None:
        return None if self.expires_days is None else self.last_active_at + self.expires_days * DAY_S

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at

    def check_usable(self, now: float, param: str = "vector_store_id") -> None:
        """A 400 for an expired store (the sweep has not removed it yet)."""
        if self.expired(now):
            raise StoreExpired(f"vector store {self.id} expired at {self.expires_at} (expires_after: "
                               f"{self.expires_days} days after last use); make a new one", param=param)


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
    days = row["expires_days"]
    return StoreRecord(row["id"], row["owner"], row["name"], int(row["created_at"]), int(row["last_active_at"]),
                       json.loads(row["metadata"]), row["model"], None if days is None else int(days))


def _store_file(row: Any) -> StoreFile:
    return StoreFile(row["store_id"], row["file_id"], int(row["created_at"]), row["status"],
                     json.loads(row["last_error"]) if row["last_error"] else None, int(row["usage_bytes"]),
                     ChunkSize(int(row["chunk_tokens"]), int(row["overlap_tokens"])), json.loads(row["attributes"]))


class StoreBook:
    """The rows of vector stores and of the files in them."""

    def __init__(self, db: Database, clock: Callable[[], float] = time.time) -> None:
        self.db = db
        self.clock = clock

    async def create(self, owner: str | None, name: str, metadata: dict[str, str], model: str,
                     expires_days: int | None = None) -> StoreRecord:
        now = int(self.clock())
        rec = StoreRecord(new_id(STORE_PREFIX), owner, name, now, now, metadata, model, expires_days)
        async with self.db.write() as conn:
            await conn.execute("INSERT INTO vector_stores (id, owner, name, created_at, last_active_at, metadata,"
                               " model, expires_days) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                               (rec.id, owner, name, now, now, json.dumps(metadata), model, expires_days))
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

    async def modify(self, rec: StoreRecord) -> StoreRecord:
        """Write ``rec``'s name, metadata and expiry over its row; a change is
        a use, so last_active_at moves to now. A 404 when the store went
        (deleted, or swept) since it was read."""
        now = int(self.clock())
        async with self.db.write() as conn:
            cur = await conn.execute("UPDATE vector_stores SET name = ?, metadata = ?, expires_days = ?,"
                                     " last_active_at = ? WHERE id = ?",
                                     (rec.name, json.dumps(rec.metadata), rec.expires_days, now, rec.id))
            changed = cur.rowcount
        if changed == 0:
            raise NotFound(f"no vector store with id {rec.id!r}", param="vector_store_id")
        return replace(rec, last_active_at=now)

    async def touch(self, store_id: str) -> None:
        async with self.db.write() as conn:
            await conn.execute("UPDATE vector_stores SET last_active_at = ? WHERE id = ?",
                               (int(self.clock()), store_id))

    async def expired_ids(self) -> list[str]:
        """The stores whose expires_after has passed, by this book's clock."""
        async with self.db.reader.execute(
                "SELECT id FROM vector_stores WHERE expires_days IS NOT NULL"
                " AND last_active_at + expires_days * ? <= ?", (DAY_S, int(self.clock()))) as cur:
            return [r[0] for r in await cur.fetchall()]

    async def used_bytes(self, owner: str, but: tuple[str, str] = ("", "")) -> int:
        """Bytes of files the stores of ``owner`` hold (a file once per
        store), less the (store id, file id) row ``but``."""
        async with self.db.reader.execute(_USED_SQL, (owner, *but)) as cur:
            row = await cur.fetchone()
        return int(row[0]) if row else 0

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
                "status": "expired" if rec.expired(self.clock()) else
                          "in_progress" if counts["in_progress"] else "completed",
                "last_active_at": rec.last_active_at, "metadata": rec.metadata,
                "expires_after": None if rec.expires_days is None else
                {"anchor": "last_active_at", "days": rec.expires_days},
                "expires_at": rec.expires_at}

    # ------------------------------------------------------------ files in stores

    async def add_file(self, store_id: str, file_id: str, size: ChunkSize, attributes: Attributes,
                       quota: Quota | None = None) -> StoreFile:
        """Add (or restart) a file's row as in_progress; with ``quota``, a 413
        when the owner's stores would hold more than it allows."""
        row = StoreFile(store_id, file_id, int(self.clock()), "in_progress", None, 0, size, attributes)
        async with self.db.write() as conn:
            if quota is not None:
                await _check_quota(conn, quota, store_id, file_id)
            await conn.execute("UPDATE vector_stores SET last_active_at = ? WHERE id = ?", (row.created_at, store_id))
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


@dataclass(frozen=True)
class Quota:
    """The bound on the bytes of files one owner's stores hold, and the size
    of the file being added."""

    owner: str
    limit: int
    file_bytes: int

    def check(self, used: int) -> None:
        if used + self.file_bytes > self.limit:
            raise QuotaExceeded(f"this key's vector stores would hold {used + self.file_bytes} bytes of files, over "
                                f"the {self.limit} bytes this server allows per key ({QUOTA_SETTING})",
                                param=QUOTA_SETTING)


async def _check_quota(conn: aiosqlite.Connection, quota: Quota, store_id: str, file_id: str) -> None:
    """In the add's transaction: the bytes the owner's stores hold, less the
    row being replaced (a file added again counts once)."""
    async with conn.execute(_USED_SQL, (quota.owner, store_id, file_id)) as cur:
        row = await cur.fetchone()
    quota.check(int(row[0]) if row else 0)
