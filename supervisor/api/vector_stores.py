"""``/v1/vector_stores``: stores, the files in them, and search, shaped as
the OpenAI SDK's types; and the knowledge base's context (the app's
:data:`KNOWLEDGE`). The work is in supervisor/knowledge/.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Annotated, Any, Literal

import msgspec
from aiohttp import web

from supervisor.api.auth import request_scope
from supervisor.api.callers import caller_of
from supervisor.api.io import decode_body, json_response
from supervisor.appkeys import CONFIG, DB, KNOWLEDGE, LIBRARY, POOL
from supervisor.errors import BadRequest
from supervisor.knowledge.chunking import ChunkSize
from supervisor.knowledge.embedder import Embedder
from supervisor.knowledge.files import FileStore
from supervisor.knowledge.records import (
    FILE_PREFIX,
    STORE_PREFIX,
    checked_id,
    page_ask,
    page_body,
)
from supervisor.knowledge.service import Knowledge
from supervisor.knowledge.stores import Attributes, FileStatus, StoreRecord
from supervisor.models.source import LibrarySource

# OpenAI's own bounds on these fields.
Key = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
Metadata = Annotated[dict[Key, Annotated[str, msgspec.Meta(max_length=512)]], msgspec.Meta(max_length=16)]
AttrValue = Annotated[str, msgspec.Meta(max_length=512)] | int | float | bool
AttributeMap = Annotated[dict[Key, AttrValue], msgspec.Meta(max_length=16)]
MAX_FILE_IDS = 500


class StaticSize(msgspec.Struct, forbid_unknown_fields=True):
    max_chunk_size_tokens: int
    chunk_overlap_tokens: int


class Chunking(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["auto", "static"]
    static: StaticSize | None = None

    def size(self, param: str) -> ChunkSize:
        if self.type == "auto":
            return ChunkSize()
        if self.static is None:
            raise BadRequest("a static chunking_strategy needs its static sizes", param=f"{param}.static")
        return ChunkSize.checked(self.static.max_chunk_size_tokens, self.static.chunk_overlap_tokens, param)


def _size(chunking: Chunking | None) -> ChunkSize:
    return ChunkSize() if chunking is None else chunking.size("chunking_strategy")


class ExpiresAfter(msgspec.Struct, forbid_unknown_fields=True):
    """OpenAI's: the store expires this many days after it was last used."""

    anchor: Literal["last_active_at"]
    days: Annotated[int, msgspec.Meta(ge=1, le=365)]


class CreateStore(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: Annotated[str, msgspec.Meta(max_length=256)] = ""
    file_ids: Annotated[list[str], msgspec.Meta(max_length=MAX_FILE_IDS)] = []
    metadata: Metadata = {}
    chunking_strategy: Chunking | None = None
    expires_after: ExpiresAfter | None = None
    description: Annotated[str, msgspec.Meta(max_length=512)] | None = None


class ModifyStore(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """OpenAI's modify: a field left out stays as it is; ``null`` clears it
    (no name, no metadata, no expiry: kept until deleted)."""

    name: Annotated[str, msgspec.Meta(max_length=256)] | None | msgspec.UnsetType = msgspec.UNSET
    metadata: Metadata | None | msgspec.UnsetType = msgspec.UNSET
    expires_after: ExpiresAfter | None | msgspec.UnsetType = msgspec.UNSET

    def apply(self, store: StoreRecord) -> StoreRecord:
        if not isinstance(self.name, msgspec.UnsetType):
            store = replace(store, name=self.name or "")
        if not isinstance(self.metadata, msgspec.UnsetType):
            store = replace(store, metadata=dict(self.metadata or {}))
        if not isinstance(self.expires_after, msgspec.UnsetType):
            store = replace(store, expires_days=None if self.expires_after is None else self.expires_after.days)
        return store


class AddFile(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    file_id: str
    attributes: AttributeMap = {}
    chunking_strategy: Chunking | None = None


class Hybrid(msgspec.Struct, forbid_unknown_fields=True):
    embedding_weight: Annotated[float, msgspec.Meta(ge=0.0, le=1e6)] = 1.0
    text_weight: Annotated[float, msgspec.Meta(ge=0.0, le=1e6)] = 1.0


class Ranking(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    ranker: Literal["none", "auto", "default-2024-11-15"] = "auto"
    score_threshold: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    hybrid_search: Hybrid | None = None


class Search(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    query: str | Annotated[list[str], msgspec.Meta(min_length=1, max_length=16)]
    max_num_results: int = 10
    filters: Any = None
    ranking_options: Ranking | None = None
    rewrite_query: bool = False


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/vector_stores", create_store)
    app.router.add_get("/v1/vector_stores", list_stores)
    app.router.add_get("/v1/vector_stores/{store_id}", retrieve_store)
    app.router.add_post("/v1/vector_stores/{store_id}", modify_store)
    app.router.add_delete("/v1/vector_stores/{store_id}", delete_store)
    app.router.add_post("/v1/vector_stores/{store_id}/files", add_file)
    app.router.add_get("/v1/vector_stores/{store_id}/files", list_files)
    app.router.add_get("/v1/vector_stores/{store_id}/files/{file_id}", retrieve_file)
    app.router.add_delete("/v1/vector_stores/{store_id}/files/{file_id}", remove_file)
    app.router.add_post("/v1/vector_stores/{store_id}/search", search)


async def knowledge_ctx(app: web.Application) -> AsyncIterator[None]:
    """The knowledge base: after the database and the pool, unwound before
    them; it owns the sweep that deletes expired stores."""
    cfg = app[CONFIG]
    embedder = Embedder(app[POOL], LibrarySource(app[LIBRARY]), cfg.file_search_embedding_model)
    knowledge = Knowledge(app[DB], FileStore(app[DB], cfg.state_path / "files", cfg.files_max_bytes), embedder,
                          max_bytes_per_key=cfg.vector_stores_max_bytes_per_key)
    app[KNOWLEDGE] = knowledge
    await knowledge.start()
    sweep = asyncio.create_task(knowledge.sweep_forever(cfg.vector_stores_sweep_interval_s),
                                name="vector-stores-sweep")
    try:
        yield
    finally:
        sweep.cancel()
        await asyncio.gather(sweep, return_exceptions=True)
        await knowledge.close()


def _store_id(request: web.Request) -> str:
    return checked_id(request.match_info["store_id"], STORE_PREFIX, "vector_store_id")


def _file_id(value: str, param: str = "file_id") -> str:
    return checked_id(value, FILE_PREFIX, param)


async def create_store(request: web.Request) -> web.Response:
    req = await decode_body(request, CreateStore)
    file_ids = [_file_id(f, f"file_ids[{i}]") for i, f in enumerate(req.file_ids)]
    knowledge = request.app[KNOWLEDGE]
    store = await knowledge.create_store(request_scope(request), req.name, dict(req.metadata), file_ids,
                                         _size(req.chunking_strategy), caller_of(request),
                                         req.expires_after.days if req.expires_after else None)
    return json_response(await knowledge.book.to_object(store))


async def list_stores(request: web.Request) -> web.Response:
    ask = page_ask(request.query, STORE_PREFIX)
    book = request.app[KNOWLEDGE].book
    stores = await book.page(request_scope(request), ask)
    return json_response(page_body([await book.to_object(s) for s in stores], ask.limit))


async def retrieve_store(request: web.Request) -> web.Response:
    book = request.app[KNOWLEDGE].book
    return json_response(await book.to_object(await book.get(_store_id(request), request_scope(request))))


async def modify_store(request: web.Request) -> web.Response:
    store_id = _store_id(request)
    req = await decode_body(request, ModifyStore)
    knowledge = request.app[KNOWLEDGE]
    store = await knowledge.modify_store(request_scope(request), store_id, req.apply)
    return json_response(await knowledge.book.to_object(store))


async def delete_store(request: web.Request) -> web.Response:
    store_id = _store_id(request)
    await request.app[KNOWLEDGE].delete_store(request_scope(request), store_id)
    return json_response({"id": store_id, "object": "vector_store.deleted", "deleted": True})


async def add_file(request: web.Request) -> web.Response:
    store_id = _store_id(request)
    req = await decode_body(request, AddFile)
    attributes: Attributes = dict(req.attributes)
    row = await request.app[KNOWLEDGE].add_file(request_scope(request), store_id, _file_id(req.file_id),
                                                _size(req.chunking_strategy), attributes, caller_of(request))
    return json_response(row.to_object())


async def list_files(request: web.Request) -> web.Response:
    store_id = _store_id(request)
    ask = page_ask(request.query, FILE_PREFIX)
    status = request.query.get("filter")
    if status not in (None, "in_progress", "completed", "failed", "cancelled"):
        raise BadRequest("filter must be in_progress, completed, failed or cancelled", param="filter")
    knowledge = request.app[KNOWLEDGE]
    await knowledge.book.get(store_id, request_scope(request))
    wanted: FileStatus | None = status  # type: ignore[assignment]  # checked just above
    rows = await knowledge.book.files_page(store_id, ask, wanted)
    return json_response(page_body([r.to_object() for r in rows], ask.limit))


async def retrieve_file(request: web.Request) -> web.Response:
    store_id = _store_id(request)
    file_id = _file_id(request.match_info["file_id"])
    knowledge = request.app[KNOWLEDGE]
    await knowledge.book.get(store_id, request_scope(request))
    return json_response((await knowledge.book.get_file(store_id, file_id)).to_object())


async def remove_file(request: web.Request) -> web.Response:
    store_id = _store_id(request)
    file_id = _file_id(request.match_info["file_id"])
    await request.app[KNOWLEDGE].remove_file(request_scope(request), store_id, file_id)
    return json_response({"id": file_id, "object": "vector_store.file.deleted", "deleted": True})


async def search(request: web.Request) -> web.Response:
    store_id = _store_id(request)
    req = await decode_body(request, Search)
    ranking = req.ranking_options or Ranking()
    hybrid = ranking.hybrid_search or Hybrid()
    if hybrid.embedding_weight == 0 and hybrid.text_weight == 0:
        raise BadRequest("embedding_weight and text_weight cannot both be 0",
                         param="ranking_options.hybrid_search")
    results = await request.app[KNOWLEDGE].search(
        request_scope(request), [store_id], req.query, req.max_num_results, req.filters,
        embedding_weight=hybrid.embedding_weight, text_weight=hybrid.text_weight,
        score_threshold=ranking.score_threshold, caller=caller_of(request))
    queries = [req.query] if isinstance(req.query, str) else req.query
    return json_response({"object": "vector_store.search_results.page", "search_query": queries,
                          "data": [r.to_object() for r in results], "has_more": False, "next_page": None})
