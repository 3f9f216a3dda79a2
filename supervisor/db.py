"""The parent's one SQLite database: connection, pragmas, migrations.

Every durable record (jobs, job events, stored responses) lives in this file.
One aiosqlite connection writes; each write is one short ``BEGIN IMMEDIATE``
transaction taken through :meth:`Database.write`. Reads go through
:attr:`Database.reader`, a second, read-only connection: under WAL it sees
only committed rows, never the writer's transaction in progress (or one that
is rolled back). Schema versions are tracked
with ``PRAGMA user_version``: migration N moves the file from version N-1 to N,
and migrations only ever append.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TypeVar

import aiosqlite

from supervisor.errors import StorageFull

log = logging.getLogger(__name__)

T = TypeVar("T")

# Retrying a write the full disk refused: soon at first, then every few
# seconds, so a record is saved within seconds of space coming back.
RETRY_FIRST_S = 0.25
RETRY_MAX_S = 4.0


async def until_stored(write: Callable[[], Awaitable[T]], what: str, *,
                       first_s: float = RETRY_FIRST_S, max_s: float = RETRY_MAX_S) -> T:
    """Run ``write`` until the disk takes it, backing off while it raises
    :class:`StorageFull`; ``what`` names the record in the log. Runs until
    cancelled: the caller owns the task, and boot recovery then deals with
    what was never saved."""
    delay = first_s
    refused = False
    while True:
        try:
            result = await write()
        except StorageFull:
            if not refused:
                log.warning("the disk is full: %s is kept in memory and saved once space returns", what)
                refused = True
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_s)
            continue
        if refused:
            log.info("%s is saved now", what)
        return result


class Database:
    """Owns the connection; use :meth:`open` and :meth:`close`."""

    def __init__(self, path: Path, migrations: Sequence[Sequence[str]]) -> None:
        self.path = path
        self._migrations = migrations
        self._conn: aiosqlite.Connection | None = None
        self._reader: aiosqlite.Connection | None = None
        self._write_lock = asyncio.Lock()

    @property
    def conn(self) -> aiosqlite.Connection:
        if self._conn is None:
            raise RuntimeError("database is not open")
        return self._conn

    @property
    def reader(self) -> aiosqlite.Connection:
        """The read-only connection: committed rows only."""
        if self._reader is None:
            raise RuntimeError("database is not open")
        return self._reader

    async def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = await aiosqlite.connect(self.path, isolation_level=None)
        conn.row_factory = aiosqlite.Row
        await conn.execute("PRAGMA journal_mode=WAL")
        await conn.execute("PRAGMA synchronous=NORMAL")
        await conn.execute("PRAGMA busy_timeout=5000")
        await conn.execute("PRAGMA foreign_keys=ON")
        self._conn = conn
        await self._migrate()
        # Opened after the migrations, so it sees the current schema.
        reader = await aiosqlite.connect(f"file:{self.path}?mode=ro", uri=True, isolation_level=None)
        reader.row_factory = aiosqlite.Row
        await reader.execute("PRAGMA busy_timeout=5000")
        await reader.execute("PRAGMA query_only=ON")
        self._reader = reader

    async def close(self) -> None:
        if self._reader is not None:
            await self._reader.close()
            self._reader = None
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

    async def user_version(self) -> int:
        async with self.conn.execute("PRAGMA user_version") as cur:
            row = await cur.fetchone()
        assert row is not None
        return int(row[0])

    async def _migrate(self) -> None:
        current = await self.user_version()
        for version, statements in enumerate(self._migrations, start=1):
            if version <= current:
                continue
            async with self.write() as conn:
                for sql in statements:
                    await conn.execute(sql)
                # PRAGMA takes no parameters; version is our own int.
                await conn.execute(f"PRAGMA user_version={version:d}")

    @asynccontextmanager
    async def write(self) -> AsyncIterator[aiosqlite.Connection]:
        """One short write transaction; rolls back if the body raises.

        A full disk is :class:`StorageFull` (507), and the transaction is
        rolled back even when COMMIT itself failed: SQLite may leave it open,
        and every later BEGIN would then fail.
        """
        async with self._write_lock:
            conn = self.conn
            try:
                await conn.execute("BEGIN IMMEDIATE")
                try:
                    yield conn
                except BaseException:
                    await conn.execute("ROLLBACK")
                    raise
                await conn.execute("COMMIT")
            except sqlite3.OperationalError as exc:
                if conn.in_transaction:
                    await conn.execute("ROLLBACK")
                if exc.sqlite_errorcode == sqlite3.SQLITE_FULL:
                    raise StorageFull("the disk holding the database is full; nothing was saved") from exc
                raise

    async def integrity_ok(self) -> bool:
        async with self.conn.execute("PRAGMA integrity_check") as cur:
            row = await cur.fetchone()
        return row is not None and row[0] == "ok"
