"""``/v1/containers/{id}/files``: the files of a code_interpreter container,
in the shape of OpenAI's container files API (create, list, retrieve,
content, delete).

A container belongs to the API key that made it (through a response or
``POST /v1/containers``): another key gets a 404, as for a container that
does not exist (or has expired); the admin sees all. The folder is the
sandboxed code's to change, so the listing is bounded
(supervisor/sandbox/containers.py scans at most ``MAX_SCANNED_ENTRIES``
entries), content is served only from a regular file reached without
following a link, at most the size a run may write
(``code_interpreter_file_mib``), and a file is put in only under a name
nothing holds yet (409 otherwise).

A file comes in as the SDK sends it: multipart with a ``file`` part (written
to disk as it arrives, refused with 413 once the container's uploads pass
the pool's ``max_upload_bytes``), or JSON ``{"file_id": "file-..."}`` naming
one of the key's ``/v1/files``, copied in.
"""

from __future__ import annotations

import asyncio
import errno
import re
from collections.abc import Mapping
from typing import BinaryIO, TypeVar
from urllib.parse import quote

import msgspec
from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import BadHttpMessage

from supervisor.api.auth import request_scope
from supervisor.api.browser import UnsupportedMediaType
from supervisor.api.io import decode_body, json_response
from supervisor.appkeys import KNOWLEDGE, RESPONSES
from supervisor.errors import (
    BadRequest,
    Conflict,
    NotFound,
    PayloadTooLarge,
    StorageFull,
)
from supervisor.knowledge.files import clean_filename
from supervisor.knowledge.records import MAX_LIST_LIMIT, page_body
from supervisor.responses.hosted.code_interpreter import input_files
from supervisor.sandbox.containers import (
    Container,
    ContainerError,
    ContainerPool,
    NameTaken,
    UnknownContainer,
    UploadTooLarge,
    check_name,
)
from supervisor.sandbox.files import (
    ContainerFile,
    copy_in,
    file_id,
    find,
    listing,
    valid_file_id,
)

CONTAINER_ID = re.compile(r"cntr_[0-9a-f]{32}")
_READ_CHUNK = 1 << 16
_MALFORMED = (AssertionError, ValueError, KeyError, BadHttpMessage)
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class AddFileById(msgspec.Struct, forbid_unknown_fields=True):
    file_id: str


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/containers/{container_id}/files", create_file)
    app.router.add_get("/v1/containers/{container_id}/files", list_files)
    app.router.add_get("/v1/containers/{container_id}/files/{file_id}", retrieve_file)
    app.router.add_delete("/v1/containers/{container_id}/files/{file_id}", delete_file)
    app.router.add_get("/v1/containers/{container_id}/files/{file_id}/content", file_content)


def pool_of(request: web.Request) -> ContainerPool | None:
    return request.app[RESPONSES].containers.pool


def container_of(request: web.Request) -> Container:
    """The container the path names, if the caller may see it; 404 otherwise."""
    cid = request.match_info["container_id"]
    if not CONTAINER_ID.fullmatch(cid):
        raise BadRequest(f"container_id {cid[:40]!r} is not a valid id (expected cntr_ and 32 hex digits)",
                         param="container_id")
    pool = pool_of(request)
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


T = TypeVar("T")


def page_of(query: Mapping[str, str], items: list[T], id_of: str) -> tuple[list[T], int]:
    """The page of ``items`` (oldest first) that limit, order and after ask
    for: up to limit + 1 of them (the extra one says there is more)."""
    raw = query.get("limit", "20")
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIST_LIMIT:
        raise BadRequest(f"limit must be an integer from 1 to {MAX_LIST_LIMIT}", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadRequest("order must be 'asc' or 'desc'", param="order")
    ordered = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        at = next((k for k, item in enumerate(ordered) if getattr(item, id_of) == after), None)
        if at is None:
            raise BadRequest(f"after names nothing of this list: {after[:40]!r}", param="after")
        ordered = ordered[at + 1:]
    limit = int(raw)
    return ordered[:limit + 1], limit


async def list_files(request: web.Request) -> web.Response:
    container = container_of(request)
    files, _ = await asyncio.to_thread(listing, container)
    page, limit = page_of(request.query, files, "id")
    return json_response(page_body([f.to_object() for f in page], limit))


async def retrieve_file(request: web.Request) -> web.Response:
    container = container_of(request)
    return json_response((await _find(container, _file_id(request))).to_object())


async def delete_file(request: web.Request) -> web.Response:
    container = container_of(request)
    info = await _find(container, _file_id(request))
    try:
        await asyncio.to_thread(container.unlink, info.name)
    except ContainerError as exc:
        # Removed or replaced by a folder since the listing.
        raise NotFound(str(exc), param="file_id") from exc
    return json_response({"id": info.id, "object": "container.file.deleted", "deleted": True})


async def create_file(request: web.Request) -> web.Response:
    container = container_of(request)
    pool = pool_of(request)
    assert pool is not None
    # Either body the SDK sends; no other (a page may post a form or text anywhere, never JSON).
    if request.content_type == "multipart/form-data":
        name = await _upload(request, pool, container)
    elif request.content_type == "application/json":
        name = await _copy(request, pool, container)
    else:
        raise UnsupportedMediaType("this route takes a multipart/form-data upload or a JSON body with a file_id, "
                                   f"not {request.content_type!r}")
    return json_response((await _find(container, file_id(container.id, name))).to_object())


async def _copy(request: web.Request, pool: ContainerPool, container: Container) -> str:
    """Copy the key's /v1/files file the JSON body names; its name in the container."""
    req = await decode_body(request, AddFileById)
    knowledge = request.app.get(KNOWLEDGE)
    if knowledge is None:
        raise BadRequest("files are not available on this server", param="file_id")
    left = pool.max_upload_bytes - container.given_bytes
    [(name, source)] = await input_files([req.file_id], knowledge.files, request_scope(request), left, "file_id",
                                         one=True)
    try:
        copied = await asyncio.to_thread(copy_in, container, [(name, source)], pool.owner_ids())
    except OSError as exc:
        if exc.errno in _DISK_FULL:
            raise StorageFull(f"file {req.file_id} could not be copied in: the disk is full") from exc
        raise
    if not copied:
        raise Conflict(f"a file named {name[:80]!r} is in container {container.id} already", param="file_id",
                       code="file_exists")
    return name


async def _upload(request: web.Request, pool: ContainerPool, container: Container) -> str:
    """Write the multipart ``file`` part into the container; its name there."""
    spool, out = pool.new_spool()
    try:
        with out:
            name, size = await _read_file_part(request, out, pool.max_upload_bytes - container.given_bytes)
        try:
            await asyncio.to_thread(pool.take, container, name, spool, size)
        except NameTaken as exc:
            raise Conflict(str(exc), param="file", code="file_exists") from exc
        except UnknownContainer as exc:
            raise NotFound(str(exc), param="container_id") from exc
        except UploadTooLarge as exc:
            raise PayloadTooLarge(str(exc), param="file") from exc
        except ContainerError as exc:
            raise BadRequest(str(exc), param="file") from exc
    finally:
        spool.unlink(missing_ok=True)  # taken: the container's name holds the file
    return name


async def _read_file_part(request: web.Request, out: BinaryIO, left: int) -> tuple[str, int]:
    """(its name, its size) of the ``file`` part, written to ``out``; a 413
    once it passes ``left`` bytes. Other parts are read past."""
    try:
        reader = await request.multipart()
        found: tuple[str, int] | None = None
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                raise BadRequest("nested multipart bodies are not accepted", param="file")
            if part.name != "file" or found is not None:
                await part.release()
                continue
            name = clean_filename(part.filename)
            try:
                check_name(name)
            except ContainerError as exc:
                raise BadRequest(str(exc), param="file") from exc
            size = 0
            while chunk := await part.read_chunk(_READ_CHUNK):
                size += len(chunk)
                if size > left:
                    raise PayloadTooLarge(f"the file is over the {left} bytes this container may still take in",
                                          param="file")
                await asyncio.to_thread(out.write, chunk)
            found = name, size
    except _MALFORMED as exc:
        raise BadRequest(f"expected a multipart/form-data body with a file part: {exc}", param="file") from exc
    if found is None:
        raise BadRequest("multipart field 'file' is missing", param="file")
    return found


async def file_content(request: web.Request) -> web.StreamResponse:
    container = container_of(request)
    pool = pool_of(request)
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
