"""Adding files to vector stores, in the background, as OpenAI does: the
file's row is ``in_progress`` at once, and one owned task per file chunks it,
embeds the chunks and stores them, then marks it ``completed`` or ``failed``
with ``last_error``. Removing a file or a store cancels its task first.

Tasks run one at a time (the embedding worker is the bottleneck, and one at
a time bounds memory to one file's text). A task interrupted by a stop is
left ``in_progress`` and started again at the next boot: indexing is
idempotent (its partial chunks are removed first).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

from supervisor.errors import ApiError
from supervisor.knowledge.chunking import ChunkSize, chunk_text
from supervisor.knowledge.embedder import Embedder
from supervisor.knowledge.stores import StoreBook, StoreFile
from supervisor.knowledge.vectors import BLOCK_CHUNKS, Vector, VectorIndex

log = logging.getLogger("gpuvisor.knowledge")

# Chunks embedded per request to the worker (the pool batches again below this).
EMBED_BATCH = 32


@dataclass(frozen=True)
class Job:
    store_id: str
    file_id: str
    path: Path
    model: str
    size: ChunkSize
    caller: str


class Indexer:
    def __init__(self, book: StoreBook, index: VectorIndex, embedder: Embedder) -> None:
        self.book = book
        self.index = index
        self.embedder = embedder
        self._tasks: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._turn = asyncio.Semaphore(1)

    def start(self, job: Job) -> None:
        key = (job.store_id, job.file_id)
        task = asyncio.create_task(self._run(job), name=f"index-{job.store_id}-{job.file_id}")
        self._tasks[key] = task
        task.add_done_callback(lambda t: self._forget(key, t))

    def _forget(self, key: tuple[str, str], task: asyncio.Task[None]) -> None:
        if self._tasks.get(key) is task:
            del self._tasks[key]
        if not task.cancelled() and task.exception() is not None:
            # _run records every failure it can; this is one it could not (the database).
            log.error("indexing %s into %s ended without a status", key[1], key[0], exc_info=task.exception())

    async def cancel(self, store_id: str, file_id: str | None = None) -> None:
        """Stop the tasks of one file in a store (every file's with None) and wait for them."""
        tasks = [t for (s, f), t in self._tasks.items() if s == store_id and file_id in (None, f)]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def wait_idle(self) -> None:
        """Until no task runs (tests and benchmarks)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks.values()), return_exceptions=True)

    async def _run(self, job: Job) -> None:
        async with self._turn:
            try:
                used = await self._index(job)
            except asyncio.CancelledError:
                raise  # removed, or the service stops: the remover or the next boot deals with it
            except ApiError as err:
                await self._fail(job, "server_error", err.message)
                return
            except (OSError, UnicodeDecodeError) as exc:
                await self._fail(job, "invalid_file", f"the file could not be read as UTF-8 text: {exc}")
                return
            except Exception:
                # A fault of ours: logged with its stack, and the file says so.
                log.exception("indexing %s into %s failed", job.file_id, job.store_id)
                await self._fail(job, "server_error", "internal error while indexing the file")
                return
            await self.book.finish_file(job.store_id, job.file_id, "completed", usage_bytes=used)
            log.info("indexed %s into %s (%d bytes)", job.file_id, job.store_id, used)

    async def _fail(self, job: Job, code: str, message: str) -> None:
        log.warning("indexing %s into %s failed: %s", job.file_id, job.store_id, message)
        await self.index.delete(job.store_id, job.file_id)
        await self.book.finish_file(job.store_id, job.file_id, "failed", error={"code": code, "message": message})

    async def _index(self, job: Job) -> int:
        await self.index.delete(job.store_id, job.file_id)  # what an interrupted run left
        text = await asyncio.to_thread(job.path.read_text, encoding="utf-8")
        limit = min(job.size.max_tokens, self.embedder.input_limit())
        size = ChunkSize(limit, min(job.size.overlap_tokens, limit // 2))
        chunks = await chunk_text(text, size, lambda t: self.embedder.count(job.model, t))
        del text
        used = 0
        for first in range(0, len(chunks), BLOCK_CHUNKS):
            block = chunks[first:first + BLOCK_CHUNKS]
            vectors: list[Vector] = []
            for at in range(0, len(block), EMBED_BATCH):
                vectors += await self.embedder.embed(job.model, block[at:at + EMBED_BATCH], job.caller)
            used += await self.index.insert(job.store_id, job.file_id, first, block, vectors)
        return used


def resumed(row: StoreFile, path: Path, model: str) -> Job:
    """The job of a file left in_progress by a stopped service."""
    return Job(row.store_id, row.file_id, path, model, row.size, "name indexer")
