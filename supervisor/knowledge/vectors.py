"""Chunk vectors in SQLite, and the search over them.

Each chunk's embedding is a unit-length little-endian float32 vector, so a
dot product is the cosine. The vectors of up to ``BLOCK_CHUNKS`` consecutive
chunks of a file are one BLOB in one ``vector_blocks`` row, beside their
chunk ids. A search reads a store's blocks one at a time on a read-only
connection of its own, scores each with one numpy matrix product and keeps
only the best candidates: memory stays one block, however large the store. Beside it, SQLite's FTS5 index ranks the
chunks by BM25 for the query's words; the two rankings are fused by
reciprocal rank (as OpenAI's hybrid search does), so a chunk that holds the
query's words ranks high even where the embedding model is weak.
"""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from supervisor.db import Database

# Chunks per vector block: one block row is read and scored at a time, so
# a scan holds at most this many vectors (4 MiB at 4,096 dimensions).
BLOCK_CHUNKS = 256
SCAN_MMAP_BYTES = 1 << 30
# Rows deleted per write transaction, so a large delete never holds the
# writer (and every other write of the service) for long.
DELETE_BATCH = 2000
# Reciprocal rank fusion's constant (the usual 60): ranks past the first
# few count less and less.
RRF_K = 60
# Candidates each ranking contributes before fusion, per result asked.
CANDIDATES_PER_RESULT = 5
MIN_CANDIDATES = 50
# The words of a query the full-text ranking uses (the rest are ignored).
MAX_QUERY_TERMS = 32
_WORD = re.compile(r"\w+")
# Keeps the chunks of the files in a JSON list (bound twice); NULL keeps all.
_FILES = " AND (? IS NULL OR file_id IN (SELECT value FROM json_each(?)))"

Vector = npt.NDArray[np.float32]


@dataclass(frozen=True)
class Hit:
    chunk_id: int
    store_id: str
    file_id: str
    text: str
    score: float


def unit(vector: npt.ArrayLike) -> Vector:
    arr = np.asarray(vector, dtype=np.float32)
    norm = float(np.linalg.norm(arr))
    return arr / norm if norm > 0 else arr


def fts_query(text: str) -> str:
    """The query's words as an FTS5 OR of quoted terms: no user text is ever
    read as FTS5 syntax (a stray quote or NEAR would be a syntax error)."""
    words = list(dict.fromkeys(w.lower() for w in _WORD.findall(text)))[:MAX_QUERY_TERMS]
    return " OR ".join(f'"{w}"' for w in words)


class VectorIndex:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def insert(self, store_id: str, file_id: str, first_seq: int,
                     texts: Sequence[str], vectors: Sequence[Vector]) -> int:
        """Store one block of a file's chunks (at most ``BLOCK_CHUNKS``): their
        rows, then their vectors in one block row, in one transaction.
        Returns their bytes (text and vectors)."""
        if not texts:
            return 0
        if len(texts) > BLOCK_CHUNKS or len(texts) != len(vectors):
            raise ValueError(f"a block holds 1 to {BLOCK_CHUNKS} chunks, each with its vector")
        matrix = np.stack([v.astype("<f4") for v in vectors])
        async with self.db.write() as conn:
            await conn.executemany("INSERT INTO chunks (store_id, file_id, seq, text) VALUES (?, ?, ?, ?)",
                                   [(store_id, file_id, first_seq + i, t) for i, t in enumerate(texts)])
            async with conn.execute("SELECT id FROM chunks WHERE store_id = ? AND file_id = ? AND seq >= ?"
                                    " AND seq < ? ORDER BY seq",
                                    (store_id, file_id, first_seq, first_seq + len(texts))) as cur:
                ids = np.array([r[0] for r in await cur.fetchall()], dtype="<i8")
            await conn.execute("INSERT INTO vector_blocks (store_id, file_id, width, chunk_ids, vectors)"
                               " VALUES (?, ?, ?, ?, ?)",
                               (store_id, file_id, matrix.shape[1], ids.tobytes(), matrix.tobytes()))
        return sum(len(t.encode()) for t in texts) + matrix.nbytes

    async def delete(self, store_id: str, file_id: str | None = None) -> int:
        """Remove a file's chunks from a store (every file's with None), in
        short transactions; returns how many went."""
        where, args = ("store_id = ?", (store_id,)) if file_id is None else \
            ("store_id = ? AND file_id = ?", (store_id, file_id))
        removed = 0
        while True:
            async with self.db.write() as conn:
                await conn.execute(f"DELETE FROM vector_blocks WHERE id IN"
                                   f" (SELECT id FROM vector_blocks WHERE {where} LIMIT ?)",
                                   (*args, DELETE_BATCH // BLOCK_CHUNKS + 1))
                cur = await conn.execute(
                    f"DELETE FROM chunks WHERE id IN (SELECT id FROM chunks WHERE {where} LIMIT ?)",
                    (*args, DELETE_BATCH))
                gone = cur.rowcount
            removed += gone
            if gone < DELETE_BATCH:
                break
        async with self.db.write() as conn:  # blocks whose chunks went in the last round
            await conn.execute(f"DELETE FROM vector_blocks WHERE {where}", args)
        return removed

    async def nearest(self, store_ids: Sequence[str], query: Vector, k: int,
                      files: Sequence[str] | None = None) -> list[tuple[int, float]]:
        """The ``k`` chunks of ``store_ids`` closest to ``query``: (chunk id,
        cosine), best first. Blocks whose width is not the query's are
        skipped (a store indexed by another model). ``files``: only chunks of
        these files (those an attribute filter selected).

        The scan runs in a thread on its own read-only connection, opened for
        it: rows come as plain tuples (no row objects, one thread hop per
        query), and the event loop never waits on it. Read-only, under WAL
        it sees committed rows only, as every reader."""
        return await asyncio.to_thread(_scan, self.db.path, list(store_ids), query, k, _only(files))

    async def keyword(self, store_ids: Sequence[str], query: str, k: int,
                      files: Sequence[str] | None = None) -> list[int]:
        """The ``k`` chunks of ``store_ids`` (and of ``files``) with the best
        BM25 for the query's words."""
        match = fts_query(query)
        if not match or not store_ids:
            return []
        marks = ",".join("?" * len(store_ids))
        async with self.db.reader.execute(
                "SELECT chunks_fts.rowid FROM chunks_fts JOIN chunks ON chunks.id = chunks_fts.rowid"
                f" WHERE chunks_fts MATCH ? AND chunks.store_id IN ({marks}){_FILES}"
                " ORDER BY chunks_fts.rank LIMIT ?", (match, *store_ids, _only(files), _only(files), k)) as cur:
            return [int(r[0]) for r in await cur.fetchall()]

    async def search(self, store_ids: Sequence[str], query_text: str, query: Vector, k: int,
                     embedding_weight: float = 1.0, text_weight: float = 1.0,
                     files: Sequence[str] | None = None) -> list[Hit]:
        """The ``k`` best chunks by the fused ranking, best first. A score is
        the fused reciprocal-rank sum over the best one possible (first in
        both rankings), so it lies in (0, 1]."""
        wanted = max(MIN_CANDIDATES, k * CANDIDATES_PER_RESULT)
        fused: dict[int, float] = {}
        if embedding_weight > 0:
            for rank, (chunk_id, _) in enumerate(await self.nearest(store_ids, query, wanted, files)):
                fused[chunk_id] = fused.get(chunk_id, 0.0) + embedding_weight / (RRF_K + rank + 1)
        if text_weight > 0:
            for rank, chunk_id in enumerate(await self.keyword(store_ids, query_text, wanted, files)):
                fused[chunk_id] = fused.get(chunk_id, 0.0) + text_weight / (RRF_K + rank + 1)
        best = (embedding_weight + text_weight) / (RRF_K + 1)
        top = sorted(fused.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
        if not top:
            return []
        rows = await self._rows([c for c, _ in top])
        return [Hit(c, *rows[c], score=min(1.0, s / best)) for c, s in top if c in rows]

    async def _rows(self, chunk_ids: list[int]) -> dict[int, tuple[str, str, str]]:
        marks = ",".join("?" * len(chunk_ids))
        async with self.db.reader.execute(f"SELECT id, store_id, file_id, text FROM chunks WHERE id IN ({marks})",
                                          chunk_ids) as cur:
            return {int(r[0]): (r[1], r[2], r[3]) for r in await cur.fetchall()}


def _top(ids: npt.NDArray[np.int64], scores: npt.NDArray[np.float32],
         k: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """The ``k`` highest scores (and their ids), best first."""
    if len(scores) > k:
        keep = np.argpartition(-scores, k - 1)[:k]
        ids, scores = ids[keep], scores[keep]
    order = np.argsort(-scores, kind="stable")
    return ids[order], scores[order]


def _only(files: Sequence[str] | None) -> str | None:
    """The files a query keeps, as one JSON parameter (any number of them
    fits in one), or None for every file."""
    return None if files is None else json.dumps(list(files))


def _scan(path: Path, store_ids: list[str], query: Vector, k: int, files: str | None) -> list[tuple[int, float]]:
    best_ids = np.empty(0, dtype=np.int64)
    best_scores = np.empty(0, dtype=np.float32)
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        conn.execute("PRAGMA query_only=ON")
        # Pages mapped rather than copied through SQLite's cache: the scan
        # reads every vector once, and this made it about a third faster.
        conn.execute(f"PRAGMA mmap_size={SCAN_MMAP_BYTES:d}")
        marks = ",".join("?" * len(store_ids))
        rows = conn.execute(f"SELECT chunk_ids, vectors FROM vector_blocks WHERE store_id IN ({marks})"
                            f" AND width = ?{_FILES}", (*store_ids, int(query.shape[0]), files, files))
        # A cursor, never fetchall: one block (at most 256 vectors) at a time.
        for chunk_ids, vectors in rows:
            ids = np.frombuffer(chunk_ids, dtype="<i8")
            scores = np.frombuffer(vectors, dtype="<f4").reshape(len(ids), -1) @ query
            best_ids, best_scores = _top(np.concatenate([best_ids, ids]), np.concatenate([best_scores, scores]), k)
    finally:
        conn.close()
    return [(int(i), float(s)) for i, s in zip(best_ids, best_scores)]
