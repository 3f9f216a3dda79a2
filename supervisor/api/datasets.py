"""HTTP routes for datasets: uploads, the listing of the datasets dir and the
dataset templates. The app must hold :data:`JOB_SETTINGS` (its roots and
upload limit).
"""

from __future__ import annotations

import asyncio
import heapq
import os
import re
import secrets
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from aiohttp import BodyPartReader, MultipartReader, web
from aiohttp.http_exceptions import BadHttpMessage

from jobs.formats import FILE_TYPES, TEMPLATES
from supervisor.api.io import json_response
from supervisor.appkeys import JOB_SETTINGS
from supervisor.errors import BadRequest, PayloadTooLarge

UPLOAD_SUFFIXES = frozenset({".jsonl", ".ndjson", ".json", ".csv", ".tsv", ".txt", ".text", ".parquet"})
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
# GET /api/datasets lists at most this many files, the newest first.
MAX_LISTED_DATASETS = 1000


def add_routes(app: web.Application) -> None:
    app.router.add_post("/api/datasets", upload_dataset)
    app.router.add_get("/api/datasets", list_datasets)
    app.router.add_get("/api/dataset/templates", dataset_templates)


def _upload_name(filename: str | None) -> str:
    # Some clients percent-encode the name in Content-Disposition.
    base = Path(unquote(filename or "")).name
    stem, dot, suffix = base.rpartition(".")
    if not dot or f".{suffix.lower()}" not in UPLOAD_SUFFIXES:
        raise BadRequest(
            f"file name must end in one of {', '.join(sorted(UPLOAD_SUFFIXES))}", param="file"
        )
    stem = _UNSAFE.sub("_", stem).strip("._-")[:100] or "dataset"
    return f"{stem}.{suffix.lower()}"


def _claim_name(tmp: Path, directory: Path, name: str) -> str:
    """Link the upload under ``name`` or the first free ``stem-N`` variant."""
    stem, _, suffix = name.rpartition(".")
    for n in range(10_000):
        candidate = name if n == 0 else f"{stem}-{n}.{suffix}"
        try:
            os.link(tmp, directory / candidate)
        except FileExistsError:
            continue
        return candidate
    raise BadRequest(f"too many files named like {name}", param="file")


async def _file_part(request: web.Request) -> tuple[MultipartReader, BodyPartReader]:
    try:
        reader = await request.multipart()
        # Skipping other fields reads them: a malformed body fails here too.
        while (part := await reader.next()) is not None:
            if isinstance(part, BodyPartReader) and part.name == "file":
                return reader, part
            await part.release()
    except (AssertionError, ValueError, KeyError, BadHttpMessage) as exc:
        raise BadRequest(f"expected a multipart/form-data body: {exc}", param="file") from exc
    raise BadRequest("multipart field 'file' is missing", param="file")


async def _read_to_end(reader: MultipartReader, part: BodyPartReader) -> None:
    """The file part ended at its boundary and the body at the closing one:
    a body cut off early (a dropped connection) is no dataset."""
    cut = BadRequest("the upload was cut off before the end of the multipart body", param="file")
    if not part.at_eof():
        raise cut
    try:
        while (rest := await reader.next()) is not None:
            await rest.release()
    except (AssertionError, ValueError, KeyError, BadHttpMessage) as exc:
        raise cut from exc
    if not reader.at_eof():
        raise cut


async def upload_dataset(request: web.Request) -> web.Response:
    settings = request.app[JOB_SETTINGS]
    reader, part = await _file_part(request)
    name = _upload_name(part.filename)
    directory = settings.roots.datasets
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".upload-{secrets.token_hex(6)}.tmp"
    size = 0
    try:
        with tmp.open("wb") as f:
            try:
                while chunk := await part.read_chunk(1 << 16):
                    size += len(chunk)
                    if size > settings.max_upload_bytes:
                        raise PayloadTooLarge(
                            f"upload exceeds the limit of {settings.max_upload_bytes} bytes", param="file"
                        )
                    f.write(chunk)
            except (AssertionError, ValueError, BadHttpMessage) as exc:
                raise BadRequest(f"malformed multipart body: {exc}", param="file") from exc
        await _read_to_end(reader, part)
        if size == 0:
            raise BadRequest("the uploaded file is empty", param="file")
        final = _claim_name(tmp, directory, name)
    finally:
        tmp.unlink(missing_ok=True)
    return json_response({"name": final, "bytes": size}, status=201)


def _dataset_files(directory: Path, limit: int) -> list[dict[str, Any]]:
    """Regular files directly in ``directory``, newest first; symlinks and
    hidden files (uploads in progress) are left out, so nothing outside is shown."""
    found: list[tuple[float, str, int]] = []
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.name.startswith(".") or not entry.is_file(follow_symlinks=False):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed while listing
                found.append((st.st_mtime, entry.name, st.st_size))
    except FileNotFoundError:
        return []
    newest = heapq.nlargest(limit, found)
    return [{"name": name, "bytes": size, "modified": round(mtime, 3)} for mtime, name, size in newest]


async def list_datasets(request: web.Request) -> web.Response:
    directory = request.app[JOB_SETTINGS].roots.datasets
    files = await asyncio.to_thread(_dataset_files, directory, MAX_LISTED_DATASETS)
    return json_response({"object": "list", "data": files})


async def dataset_templates(request: web.Request) -> web.Response:
    return json_response({"object": "list", "data": TEMPLATES, "file_types": FILE_TYPES})
