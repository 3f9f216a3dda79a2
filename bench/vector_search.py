"""What a file_search query costs at scale: the bounded scan over SQLite.

One run builds a knowledge-base database (the service's own schema and
code, supervisor/knowledge/) with N chunks of random unit vectors and
random words in one vector store, then times, per query:

- ``scan``: the cosine top-k the service runs (supervisor/knowledge/vectors.py):
  blocks of 256 vectors read from SQLite on a read-only connection, one
  numpy product per block;
- ``in-RAM``: the same top-k over the same vectors held in one numpy
  matrix (what the scan would cost with no database: the floor);
- ``hybrid``: the whole search the API answers, scan plus SQLite FTS5
  BM25 fused by reciprocal rank, and the chunks' rows read back.

It prints milliseconds per query (median and p95), the scan's ratio to the
in-RAM floor, and the memory the scan allocates at its peak (tracemalloc),
against the size of all vectors.

``python -m bench.vector_search [--chunks 100000] [--dim 768] [--queries 20]``
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from supervisor.db import Database  # noqa: E402
from supervisor.knowledge.schema import KNOWLEDGE_SCHEMA, VECTOR_BLOCKS_SCHEMA  # noqa: E402
from supervisor.knowledge.vectors import BLOCK_CHUNKS, VectorIndex, unit  # noqa: E402

WORDS = [f"w{i}" for i in range(5000)]
STORE = "vs_" + "0" * 24


async def build(db: Database, chunks: int, dim: int, rng: np.random.Generator) -> np.ndarray:
    """Insert ``chunks`` rows through the service's own insert (in its blocks); returns the vectors."""
    index = VectorIndex(db)
    async with db.write() as conn:
        await conn.execute("INSERT INTO vector_stores (id, owner, name, created_at, last_active_at, metadata, model)"
                           " VALUES (?, NULL, 'bench', 0, 0, '{}', 'bench')", (STORE,))
    all_vectors = rng.standard_normal((chunks, dim), dtype=np.float32)
    all_vectors /= np.linalg.norm(all_vectors, axis=1, keepdims=True)
    for first in range(0, chunks, BLOCK_CHUNKS):
        n = min(BLOCK_CHUNKS, chunks - first)
        picks = rng.integers(0, len(WORDS), (n, 60))
        texts = [" ".join(WORDS[i] for i in row) for row in picks]
        await index.insert(STORE, f"file-{first // 1000:024x}", first, texts,
                           list(all_vectors[first:first + n]))
    return all_vectors


async def timed(fn: Callable[[], Awaitable[object]], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        await fn()
        out.append((time.perf_counter() - start) * 1000)
    return out


def summary(name: str, ms: list[float]) -> str:
    p95 = sorted(ms)[max(0, int(len(ms) * 0.95) - 1)]
    return f"{name:>8}: median {statistics.median(ms):8.1f} ms   p95 {p95:8.1f} ms"


async def main(chunks: int, dim: int, queries: int, k: int) -> None:
    rng = np.random.default_rng(7)
    with tempfile.TemporaryDirectory(prefix="gvbench") as tmp:
        db = Database(Path(tmp) / "kb.db", [KNOWLEDGE_SCHEMA, VECTOR_BLOCKS_SCHEMA])
        await db.open()
        try:
            started = time.perf_counter()
            matrix = await build(db, chunks, dim, rng)
            print(f"built {chunks} chunks of {dim} dims in {time.perf_counter() - started:.1f} s "
                  f"(database {(Path(tmp) / 'kb.db').stat().st_size / 2**20:.0f} MiB, "
                  f"vectors {matrix.nbytes / 2**20:.0f} MiB)")
            index = VectorIndex(db)
            query = unit(rng.standard_normal(dim))
            words = " ".join(rng.choice(WORDS, 4))

            def in_ram() -> Awaitable[None]:
                async def run() -> None:
                    scores = matrix @ query
                    top = np.argpartition(-scores, k)[:k]
                    top[np.argsort(-scores[top])]
                return run()

            # The scan and the floor agree on the answer before they are timed.
            scanned = [c for c, _ in await index.nearest([STORE], query, k)]
            floor = np.argsort(-(matrix @ query))[:k] + 1  # chunk ids start at 1, in insert order
            assert scanned == [int(i) for i in floor], "the scan disagrees with the in-RAM top-k"

            scan_ms = await timed(lambda: index.nearest([STORE], query, k), queries)
            ram_ms = await timed(in_ram, queries)
            hybrid_ms = await timed(lambda: index.search([STORE], words, query, k), queries)
            tracemalloc.start()
            await index.nearest([STORE], query, k)
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            print(summary("scan", scan_ms))
            print(summary("in-RAM", ram_ms))
            print(summary("hybrid", hybrid_ms))
            print(f"scan / in-RAM: {statistics.median(scan_ms) / statistics.median(ram_ms):.1f}x; "
                  f"scan peak allocation {peak / 2**20:.1f} MiB against {matrix.nbytes / 2**20:.0f} MiB of vectors")
        finally:
            await db.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--queries", type=int, default=20)
    parser.add_argument("-k", type=int, default=50)
    args = parser.parse_args()
    asyncio.run(main(args.chunks, args.dim, args.queries, args.k))
