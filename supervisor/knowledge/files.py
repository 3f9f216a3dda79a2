"""Uploaded files: their records in SQLite, their bytes in the state dir.

An upload is written to a temp file beside its final place as it arrives
(:class:`Spool`): never the whole body in memory, and never more than the
size limit on disk. While it is written, it is decoded as UTF-8 a piece at a
time, so whether a file is text (and so may join a vector store) is known
when the upload ends, without reading it again.
"""

from __future__ import annotations

import codecs
import os
import time
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.db import Database
from supervisor.errors import BadRequest, NotFound, PayloadTooLarge
from supervisor.knowledge.records import FILE_PREFIX, SCOPED, PageAsk, new_id, page_sql, scope_args

PURPOSES = ("assistants", "user_data")
# The kinds of text a vector store takes: plain text, markdown, JSON and CSV
# (by name, and the bytes must be UTF-8 with no NUL).
TEXT_SUFFIXES = frozenset({".txt", ".text", ".md", ".markdown", ".json", ".jsonl", ".csv", ".tsv"})
MAX_FILENAME_CHARS = 255


@dataclass(frozen=True)
class FileRecord:
    id: str
    owner: str | None
    filename: str
    purpose: str
    bytes: int
    created_at: int
    is_text: bool

    def to_object(self) -> dict[str, Any]:
        """The SDK's ``FileObject``."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "expires_at": None, "status_details": None}

    @property
    def searchable(self) -> bool:
        return self.is_text and Path(self.filename).suffix.lower() in TEXT_SUFFIXES


def clean_filename(raw: str | None) -> str:
    """The name a client gave, as shown back: its last path part, without
    control characters, at most 255 characters. It never names a path on
    disk (the bytes are stored under the file's id)."""
    base = (raw or "").replace("\\", "/").rsplit("/", 1)[-1]
    base = "".join(c for c in base if unicodedata.category(c)[0] != "C").strip()
    if not base or base in (".", ".."):
        raise BadRequest("the file part needs a filename", param="file")
    return base[:MAX_FILENAME_CHARS]


def checked_purpose(raw: str) -> str:
    if raw not in PURPOSES:
        raise BadRequest(f"purpose must be one of {', '.join(PURPOSES)}", param="purpose")
    return raw


class Spool:
    """One upload being written to ``path``; :meth:`write` raises 413 past ``limit``."""

    def __init__(self, path: Path, limit: int) -> None:
        self.path = path
        self.limit = limit
        self.size = 0
        self.utf8 = True
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._file = path.open("xb")

    def write(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.limit:
            raise PayloadTooLarge(f"the file exceeds the limit of {self.limit} bytes (files_max_bytes)",
                                  param="file")
        self._file.write(chunk)
        if self.utf8:
            self._check_text(chunk, final=False)

    def _check_text(self, chunk: bytes, *, final: bool) -> None:
        try:
            text = self._decoder.decode(chunk, final=final)
        except UnicodeDecodeError:
            self.utf8 = False
            return
        if "\x00" in text:
            self.utf8 = False

    def finish(self) -> None:
        if self.utf8:
            self._check_text(b"", final=True)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    def discard(self) -> None:
        self._file.close()
        self.path.unlink(missing_ok=True)


def _record(row: Any) -> FileRecord:
    return FileRecord(row["id"], row["owner"], row["filename"], row["purpose"], int(row["bytes"]),
                      int(row["created_at"]), bool(row["is_text"]))


class FileStore:
    """Records and bytes of uploaded files, each owned by the key that sent it."""

    def __init__(self, db: Database, root: Path, max_bytes: int, clock: Callable[[], float] = time.time) -> None:
        self.db = db
        self.root = root
        self.max_bytes = max_bytes
        self.clock = clock

    def open_spool(self) -> Spool:
        """A temp file for an upload, beside where it will live (one rename away)."""
        self.root.mkdir(parents=True, exist_ok=True)
        return Spool(self.root / f".upload-{new_id('')}.tmp", self.max_bytes)

    def path(self, file_id: str) -> Path:
        return self.root / file_id

    async def add(self, spool: Spool, filename: str, purpose: str, owner: str | None) -> FileRecord:
        """Keep a finished upload: its bytes under its id, then its record."""
        if spool.size == 0:
            raise BadRequest("the uploaded file is empty", param="file")
        rec = FileRecord(new_id(FILE_PREFIX), owner, filename, purpose, spool.size, int(self.clock()), spool.utf8)
        os.replace(spool.path, self.path(rec.id))
        try:
            async with self.db.write() as conn:
                await conn.execute(
                    "INSERT INTO files (id, owner, filename, purpose, bytes, created_at, is_text)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (rec.id, owner, filename, purpose, rec.bytes, rec.created_at, int(rec.is_text)))
        except BaseException:
            self.path(rec.id).unlink(missing_ok=True)
            raise
        return rec

    async def get(self, file_id: str, scope: str | None) -> FileRecord:
        """The file, if ``scope`` may see it; else 404 (as if it did not exist)."""
        async with self.db.reader.execute("SELECT * FROM files WHERE id = ?" + SCOPED,
                                          (file_id, *scope_args(scope))) as cur:
            row = await cur.fetchone()
        if row is None:
            raise NotFound(f"no file with id {file_id!r}", param="file_id")
        return _record(row)

    async def page(self, scope: str | None, ask: PageAsk, purpose: str | None) -> list[FileRecord]:
        """Up to ``ask.limit + 1`` files of ``scope`` (one more says there is more)."""
        sql, args = "SELECT * FROM files WHERE 1" + SCOPED, list[object](scope_args(scope))
        if purpose is not None:
            sql, args = sql + " AND purpose = ?", [*args, purpose]
        cursor, order = page_sql(ask, "files")
        if ask.after is not None:
            await self.get(ask.after, scope)
            sql, args = sql + cursor, [*args, ask.after]
        async with self.db.reader.execute(sql + order, (*args, ask.limit + 1)) as cur:
            return [_record(r) for r in await cur.fetchall()]

    async def remove(self, file_id: str) -> None:
        """Forget the record, then the bytes (the caller removed its chunks first)."""
        async with self.db.write() as conn:
            await conn.execute("DELETE FROM files WHERE id = ?", (file_id,))
        self.path(file_id).unlink(missing_ok=True)

    def remove_leftover_spools(self) -> None:
        """Temp files of uploads a stopped service never finished."""
        if not self.root.is_dir():
            return
        for leftover in self.root.glob(".upload-*.tmp"):
            leftover.unlink(missing_ok=True)
