"""``/v1/files``: upload (multipart, as the OpenAI SDKs send it), list,
retrieve, content and delete. Files are the knowledge base's
(supervisor/knowledge/); the app must hold :data:`KNOWLEDGE`.

An upload is written to disk as it arrives and refused with 413 once it
passes ``files_max_bytes``; only the small ``purpose`` field is read into memory.
"""

from __future__ import annotations

import asyncio
from urllib.parse import quote

from aiohttp import BodyPartReader, MultipartReader, web
from aiohttp.http_exceptions import BadHttpMessage

from supervisor.api.auth import request_scope
from supervisor.api.io import json_response
from supervisor.appkeys import KNOWLEDGE
from supervisor.errors import BadRequest
from supervisor.knowledge.files import PURPOSES, FileRecord, Spool, checked_purpose, clean_filename
from supervisor.knowledge.records import FILE_PREFIX, checked_id, page_ask, page_body

# The longest text field we read (purpose); anything longer is no purpose of ours.
MAX_FIELD_BYTES = 64
READ_CHUNK = 1 << 16
_MALFORMED = (AssertionError, ValueError, KeyError, BadHttpMessage)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/files", upload)
    app.router.add_get("/v1/files", list_files)
    app.router.add_get("/v1/files/{file_id}", retrieve)
    app.router.add_get("/v1/files/{file_id}/content", content)
    app.router.add_delete("/v1/files/{file_id}", delete)


async def _small_field(part: BodyPartReader, name: str) -> str:
    data = b""
    while chunk := await part.read_chunk(MAX_FIELD_BYTES + 1):
        data += chunk
        if len(data) > MAX_FIELD_BYTES:
            raise BadRequest(f"{name} is too long", param=name)
    try:
        return data.decode()
    except UnicodeDecodeError as exc:
        raise BadRequest(f"{name} is not UTF-8 text", param=name) from exc


async def _spool_file(part: BodyPartReader, spool: Spool) -> None:
    while chunk := await part.read_chunk(READ_CHUNK):
        spool.write(chunk)
    if not part.at_eof():
        raise BadRequest("the upload was cut off before the end of the file part", param="file")


async def upload(request: web.Request) -> web.Response:
    knowledge = request.app[KNOWLEDGE]
    try:
        reader = await request.multipart()
    except _MALFORMED as exc:
        raise BadRequest(f"expected a multipart/form-data body with file and purpose: {exc}", param="file") from exc
    spool = knowledge.files.open_spool()
    try:
        purpose, filename = await _read_parts(reader, spool)
        await asyncio.to_thread(spool.finish)  # its fsync may take a while on a busy disk
        rec = await knowledge.files.add(spool, filename, purpose, request_scope(request))
    finally:
        spool.discard()  # nothing once it was kept (its temp name is gone)
    return json_response(rec.to_object())


async def _read_parts(reader: MultipartReader, spool: Spool) -> tuple[str, str]:
    """(purpose, filename), the file's bytes written to ``spool``."""
    purpose: str | None = None
    filename: str | None = None
    try:
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                raise BadRequest("nested multipart bodies are not accepted", param="file")
            if part.name == "purpose":
                purpose = checked_purpose(await _small_field(part, "purpose"))
            elif part.name == "file" and filename is None:
                filename = clean_filename(part.filename)
                await _spool_file(part, spool)
            else:
                await part.release()  # fields we do not use (expires_after): read past, never kept
    except _MALFORMED as exc:
        raise BadRequest(f"malformed multipart body: {exc}", param="file") from exc
    if filename is None:
        raise BadRequest("multipart field 'file' is missing", param="file")
    if purpose is None:
        raise BadRequest(f"multipart field 'purpose' is missing (one of {', '.join(PURPOSES)})", param="purpose")
    return purpose, filename


async def _file(request: web.Request) -> FileRecord:
    file_id = checked_id(request.match_info["file_id"], FILE_PREFIX, "file_id")
    return await request.app[KNOWLEDGE].files.get(file_id, request_scope(request))


async def list_files(request: web.Request) -> web.Response:
    ask = page_ask(request.query, FILE_PREFIX, default_limit=100)
    purpose = request.query.get("purpose")
    if purpose is not None:
        checked_purpose(purpose)
    records = await request.app[KNOWLEDGE].files.page(request_scope(request), ask, purpose)
    return json_response(page_body([r.to_object() for r in records], ask.limit))


async def retrieve(request: web.Request) -> web.Response:
    return json_response((await _file(request)).to_object())


async def content(request: web.Request) -> web.FileResponse:
    rec = await _file(request)
    # Served as bytes with its name: never rendered by a browser as a page.
    return web.FileResponse(request.app[KNOWLEDGE].files.path(rec.id), headers={
        "Content-Type": "application/octet-stream",
        "Content-Disposition": f"attachment; filename*=UTF-8''{_quoted(rec.filename)}"})


def _quoted(name: str) -> str:
    return quote(name, safe="")


async def delete(request: web.Request) -> web.Response:
    rec = await _file(request)
    await request.app[KNOWLEDGE].delete_file(request_scope(request), rec.id)
    return json_response({"id": rec.id, "object": "file", "deleted": True})
