"""The knowledge base: files, vector stores and search, for the routes and
for the Responses tool loop (``file_search``).

Everything is scoped to the API key that made it: ``scope`` is that key's
id, or None for the admin (and with authentication off), which sees all.
Another key's file or store is a 404, as if it did not exist.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from supervisor.db import Database
from supervisor.errors import ApiError, BadRequest, NotFound
from supervisor.knowledge.chunking import ChunkSize
from supervisor.knowledge.embedder import Embedder
from supervisor.knowledge.files import FileRecord, FileStore
from supervisor.knowledge.filters import parse as parse_filters
from supervisor.knowledge.indexer import Indexer, Job, resumed
from supervisor.knowledge.stores import (
    Attributes,
    Quota,
    StoreBook,
    StoreFile,
    StoreRecord,
)
from supervisor.knowledge.vectors import VectorIndex

log = logging.getLogger("gpuvisor.knowledge")

MAX_RESULTS = 50
MAX_STORES_PER_SEARCH = 16
MAX_QUERY_CHARS = 16384


@dataclass(frozen=True)
class SearchResult:
    """One chunk a search found: what ``file_search_call`` results and the
    search page show."""

    vector_store_id: str
    file_id: str
    filename: str
    score: float
    text: str
    attributes: Attributes

    def to_object(self) -> dict[str, Any]:
        """The SDK's ``VectorStoreSearchResponse``."""
        return {"file_id": self.file_id, "filename": self.filename, "score": self.score,
                "attributes": self.attributes, "content": [{"type": "text", "text": self.text}]}

    def to_call_result(self) -> dict[str, Any]:
        """One of a Responses ``file_search_call`` item's ``results``."""
        return {"file_id": self.file_id, "filename": self.filename, "score": self.score,
                "attributes": self.attributes, "text": self.text}


class Knowledge:
    def __init__(self, db: Database, files: FileStore, embedder: Embedder, *, max_bytes_per_key: int = 0,
                 clock: Callable[[], float] = time.time) -> None:
        """``max_bytes_per_key``: the bytes of files one key's stores may hold
        together (0: no bound; the admin's stores are never bound)."""
        self.files = files
        self.max_bytes_per_key = max_bytes_per_key
        self.book = StoreBook(db, clock)
        self.index = VectorIndex(db)
        self.embedder = embedder
        self.indexer = Indexer(self.book, self.index, embedder)

    async def start(self) -> None:
        """Drop unfinished uploads; index again what a stop interrupted."""
        self.files.remove_leftover_spools()
        for row in await self.book.files_in_progress():
            store = await self.book.get(row.store_id, None)
            self.indexer.start(resumed(row, self.files.path(row.file_id), store.model))

    async def close(self) -> None:
        await self.indexer.close()

    # ------------------------------------------------------------ stores

    async def create_store(self, scope: str | None, name: str, metadata: dict[str, str],
                           file_ids: Sequence[str], size: ChunkSize, caller: str,
                           expires_days: int | None = None) -> StoreRecord:
        model = self.embedder.current()
        records = list({r.id: r for r in [await self._searchable(scope, f) for f in file_ids]}.values())
        # All checked before any is added: no store is left half made by a refusal.
        if scope is not None and self.max_bytes_per_key:
            Quota(scope, self.max_bytes_per_key, sum(r.bytes for r in records)).check(
                await self.book.used_bytes(scope))
        store = await self.book.create(scope, name, metadata, model, expires_days)
        for rec in records:
            await self._add(store, rec, size, {}, caller)
        return store

    async def modify_store(self, scope: str | None, store_id: str, change: Callable[[StoreRecord], StoreRecord]
                           ) -> StoreRecord:
        """The store after ``change`` (a new name, metadata or expiry) is
        written; an expired store is refused as for any other use (the sweep
        removes it), so a change cannot bring it back."""
        store = await self.book.get(store_id, scope)
        store.check_usable(self.book.clock())
        return await self.book.modify(change(store))

    async def delete_store(self, scope: str | None, store_id: str) -> None:
        await self.book.get(store_id, scope)
        await self._remove_store(store_id)

    async def _remove_store(self, store_id: str) -> None:
        await self.indexer.cancel(store_id)
        await self.index.delete(store_id)
        await self.book.remove(store_id)

    async def sweep(self) -> list[str]:
        """Delete the stores whose expires_after has passed (their chunks,
        then their rows; the files stay). Returns their ids."""
        gone = await self.book.expired_ids()
        for store_id in gone:
            await self._remove_store(store_id)
        return gone

    async def sweep_forever(self, interval_s: float) -> None:
        """:meth:`sweep` every ``interval_s`` until cancelled, by the owner
        of the service. A failed pass is logged and the next one tries again."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                gone = await self.sweep()
            except (sqlite3.Error, OSError, ApiError):
                log.exception("the sweep of expired vector stores failed; it runs again in %g s", interval_s)
                continue
            if gone:
                log.info("removed %d expired vector stores: %s", len(gone), ", ".join(gone))

    async def add_file(self, scope: str | None, store_id: str, file_id: str, size: ChunkSize,
                       attributes: Attributes, caller: str) -> StoreFile:
        store = await self.book.get(store_id, scope)
        store.check_usable(self.book.clock())
        self.embedder.check(store.model)
        rec = await self._searchable(scope, file_id)
        return await self._add(store, rec, size, attributes, caller)

    async def _searchable(self, scope: str | None, file_id: str) -> FileRecord:
        rec = await self.files.get(file_id, scope)
        if not rec.searchable:
            raise BadRequest(f"file {file_id} ({rec.filename}) cannot join a vector store: only UTF-8 text files "
                             "(.txt, .md, .json, .jsonl, .csv, .tsv) are searchable", param="file_id",
                             code="unsupported_file")
        return rec

    async def _add(self, store: StoreRecord, rec: FileRecord, size: ChunkSize, attributes: Attributes,
                   caller: str) -> StoreFile:
        # The store's owner pays, whoever adds (the admin may add to a key's store).
        quota = Quota(store.owner, self.max_bytes_per_key, rec.bytes) \
            if store.owner is not None and self.max_bytes_per_key else None
        if quota is not None:
            # Before the cancel below: a refused re-add leaves the file's indexing as it was.
            quota.check(await self.book.used_bytes(quota.owner, (store.id, rec.id)))
        await self.indexer.cancel(store.id, rec.id)  # added again: index it afresh
        # The add checks the quota again in its own transaction: the word that counts.
        row = await self.book.add_file(store.id, rec.id, size, attributes, quota)
        self.indexer.start(Job(store.id, rec.id, self.files.path(rec.id), store.model, size, caller))
        return row

    async def remove_file(self, scope: str | None, store_id: str, file_id: str) -> None:
        """Take a file out of a store (its chunks go; the file stays)."""
        await self.book.get(store_id, scope)
        await self.book.get_file(store_id, file_id)
        await self.indexer.cancel(store_id, file_id)
        await self.index.delete(store_id, file_id)
        await self.book.remove_file(store_id, file_id)

    async def delete_file(self, scope: str | None, file_id: str) -> None:
        """Delete a file, and take it out of every store that holds it."""
        await self.files.get(file_id, scope)
        for store_id in await self.book.stores_of_file(file_id):
            await self.indexer.cancel(store_id, file_id)
            await self.index.delete(store_id, file_id)
            await self.book.remove_file(store_id, file_id)
        await self.files.remove(file_id)

    # ------------------------------------------------------------ search

    async def search(self, scope: str | None, store_ids: Sequence[str], query: str | Sequence[str],
                     max_num_results: int = 10, filters: object | None = None, *,
                     embedding_weight: float = 1.0, text_weight: float = 1.0,
                     score_threshold: float = 0.0, caller: str = "") -> list[SearchResult]:
        """The chunks of the stores ``scope`` may see that best answer
        ``query``, best first, at most ``max_num_results`` (1..50).

        The ranking fuses the cosine of the query's embedding (by the
        stores' own model) with BM25 over the query's words
        (``vectors.py``); ``embedding_weight`` and ``text_weight`` weigh
        the two, and results scoring under ``score_threshold`` are left
        out. ``filters`` is an OpenAI attribute filter (``filters.py``) over
        the attributes each file was added with. Errors are
        :class:`ApiError`s naming the field: a store ``scope`` cannot see is
        a 404, a query over the model's input or a bad filter a 400.
        """
        match = None if filters is None else parse_filters(filters)
        if not 1 <= max_num_results <= MAX_RESULTS:
            raise BadRequest(f"max_num_results must be from 1 to {MAX_RESULTS}", param="max_num_results")
        if not 1 <= len(store_ids) <= MAX_STORES_PER_SEARCH:
            raise BadRequest(f"name 1 to {MAX_STORES_PER_SEARCH} vector stores", param="vector_store_ids")
        text = query if isinstance(query, str) else "\n".join(query)
        if not text.strip():
            raise BadRequest("query must not be empty", param="query")
        if len(text) > MAX_QUERY_CHARS:
            raise BadRequest(f"query is over {MAX_QUERY_CHARS} characters", param="query")
        stores = [await self.book.get(s, scope) for s in dict.fromkeys(store_ids)]
        for store in stores:
            store.check_usable(self.book.clock(), "vector_store_ids" if len(stores) > 1 else "vector_store_id")
        models = {s.model for s in stores}
        if len(models) > 1:
            raise BadRequest("these vector stores were made with different embedding models; search them apart",
                             param="vector_store_ids")
        model = models.pop()
        self.embedder.check(model)
        tokens = await self.embedder.count(model, text)
        if tokens > self.embedder.input_limit():
            raise BadRequest(f"query is {tokens} tokens; the embedding model takes at most "
                             f"{self.embedder.input_limit()}", param="query")
        [vector] = await self.embedder.embed(model, [text], caller)
        files = None if match is None else [
            row.file_id for s in stores for row in await self.book.completed_files(s.id) if match(row.attributes)]
        hits = await self.index.search([s.id for s in stores], text, vector, max_num_results,
                                       embedding_weight, text_weight, files)
        for store in stores:
            await self.book.touch(store.id)
        results = [await self._result(h.store_id, h.file_id, h.score, h.text) for h in hits
                   if h.score >= score_threshold]
        return [r for r in results if r is not None]

    async def _result(self, store_id: str, file_id: str, score: float, text: str) -> SearchResult | None:
        """The result of one chunk; None for a file still being indexed (a
        search sees only whole files) or removed since the scan."""
        try:
            rec = await self.files.get(file_id, None)
            row = await self.book.get_file(store_id, file_id)
        except NotFound:
            return None
        if row.status != "completed":
            return None
        return SearchResult(store_id, file_id, rec.filename, round(score, 6), text, row.attributes)
