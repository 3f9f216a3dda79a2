"""``/v1/containers/{id}/files``: the files of a code_interpreter container,
in the shape of OpenAI's container files API (list, retrieve, content).

A container belongs to the API key whose response made it: another key
gets a 404, as for a container that does not exist (or has expired); the
admin sees all. The folder is the sandboxed code's to change, so the
listing is bounded (supervisor/sandbox/containers.py scans at most
``MAX_SCANNED_ENTRIES`` entries) and content is served only from a
regular file reached without following a link, at most the size a run
may write (``code_interpreter_file_mib``).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from urllib.parse import quote

from aiohttp import web

from supervisor.api.auth import request_scope
from supervisor.api.io import json_response
from supervisor.appkeys import RESPONSES
from supervisor.errors import BadRequest, NotFound
from supervisor.knowledge.records import MAX_LIST_LIMIT, page_body
from supervisor.sandbox.containers import Container, ContainerError, ContainerPool
from supervisor.sandbox.files import ContainerFile, find, listing, valid_file_id

_CONTAINER_ID = re.compile(r"cntr_[0-9a-f]{32}")
_READ_CHUNK = 1 << 16


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/containers/{container_id}/files", list_files)
    app.router.add_get("/v1/containers/{container_id}/files/{file_id}", retrieve_file)
    app.router.add_get("/v1/containers/{container_id}/files/{file_id}/content", file_content)


def _pool(request: web.Request) -> ContainerPool | None:
    return request.app[RESPONSES].containers.pool


def _container(request: web.Request) -> Container:
    """The container the path names, if the caller may see it; 404 otherwise."""
    cid = request.match_info["container_id"]
    if not _CONTAINER_ID.fullmatch(cid):
        raise BadRequest(f"container_id {cid[:40]!r} is not a valid id (expected cntr_ and 32 hex digits)",
                         param="container_id")
    pool = _pool(request)
    if pool is None:
        raise NotFound(f"no container {cid!r} (code_interpreter is off on this server)", param="container_id")
    try:
        return pool.get(cid, request_scope(request))
    except ContainerError as exc:
        raise NotFound(str(exc), param="container_id") from exc


def _file_id(request: web.Request) -> str:
    fid = request.match_info["file_id"]
    if not valid_file_id(fid):
        raise BadRequest(f"file_id {fid[:40]!r} is not a valid id (expected cfile_ and 32 hex digits)",
                         param="file_id")
    return fid


async def _find(container: Container, fid: str) -> ContainerFile:
    try:
        return await asyncio.to_thread(find, container, fid)
    except ContainerError as exc:
        raise NotFound(str(exc), param="file_id") from exc


def _page(query: Mapping[str, str], files: list[ContainerFile]) -> tuple[list[ContainerFile], int]:
    """The page of ``files`` (oldest first) that limit, order and after ask for."""
    raw = query.get("limit", "20")
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIST_LIMIT:
        raise BadRequest(f"limit must be an integer from 1 to {MAX_LIST_LIMIT}", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadRequest("order must be 'asc' or 'desc'", param="order")
    ordered = files if order == "asc" else files[::-1]
    after = query.get("after")
    if after is not None:
        at = next((k for k, f in enumerate(ordered) if f.id == after), None)
        if at is None:
            raise BadRequest(f"after names no file of this container: {after[:40]!r}", param="after")
        ordered = ordered[at + 1:]
    limit = int(raw)
    return ordered[:limit + 1], limit


async def list_files(request: web.Request) -> web.Response:
    container = _container(request)
    files, _ = await asyncio.to_thread(listing, container)
    page, limit = _page(request.query, files)
    return json_response(page_body([f.to_object() for f in page], limit))


async def retrieve_file(request: web.Request) -> web.Response:
    container = _container(request)
    return json_response((await _find(container, _file_id(request))).to_object())


async def file_content(request: web.Request) -> web.StreamResponse:
    container = _container(request)
    pool = _pool(request)
    assert pool is not None
    info = await _find(container, _file_id(request))
    limit = pool.spec.limits.file_mib << 20
    try:
        f, size = await asyncio.to_thread(container.open, info.name, limit)
    except ContainerError as exc:
        # Replaced by a link, a folder or a bigger file since the listing.
        raise NotFound(str(exc), param="file_id") from exc
    with f:
        # Served as bytes with its name: never rendered by a browser as a page.
        response = web.StreamResponse(headers={
            "Content-Type": "application/octet-stream",
            "Content-Disposition": f"attachment; filename*=UTF-8''{quote(info.name.rsplit('/', 1)[-1], safe='')}"})
        response.content_length = size
        await response.prepare(request)
        left = size
        # Never more than the size it had when opened: a file the code still writes is cut there.
        while left > 0 and (chunk := await asyncio.to_thread(f.read, min(_READ_CHUNK, left))):
            await response.write(chunk)
            left -= len(chunk)
        await response.write_eof()
    return response
