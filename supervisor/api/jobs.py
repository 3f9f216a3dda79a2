"""HTTP routes of the lab: jobs, their events (SSE) and logs, dataset uploads,
dataset templates and the GPU lease snapshot.

The app must hold :data:`JOB_STORE`, :data:`JOB_RUNNER`, :data:`LEASE` and
:data:`JOB_SETTINGS`; handlers raise :mod:`supervisor.errors` classes and the
app's middleware renders them.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import unquote

import msgspec
from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import BadHttpMessage

from jobs.formats import FILE_TYPES, TEMPLATES
from jobs.params import ModelLookup, ResolveContext, Roots, validate_params
from supervisor.api.io import (
    SseWriter,
    decode_body,
    decode_json,
    json_response,
    read_body,
)
from supervisor.appkeys import ENGINE_CHECK, JOB_RUNNER, JOB_SETTINGS, JOB_STORE, LEASE
from supervisor.errors import BadRequest, PayloadTooLarge
from supervisor.lab.hub import Subscription
from supervisor.lab.store import FINISHED, JobStore
from supervisor.workers.engine_check import EngineBuild

UPLOAD_SUFFIXES = frozenset({".jsonl", ".ndjson", ".json", ".csv", ".tsv", ".txt", ".text", ".parquet"})
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_STATUSES = frozenset({"queued", "running", *FINISHED})


@dataclass(frozen=True)
class JobSettings:
    roots: Roots
    max_upload_bytes: int = 1 << 30
    sse_heartbeat_s: float = 15.0
    sse_retry_ms: int = 2000
    log_max_bytes: int = 1 << 20
    # Maps a model id from /v1/models to its GGUF file (the model library).
    model_lookup: ModelLookup | None = None




class SubmitBody(msgspec.Struct, forbid_unknown_fields=True):
    kind: str
    params: dict[str, Any] = {}
    priority: Annotated[int, msgspec.Meta(ge=-1000, le=1000)] = 0


def add_routes(app: web.Application) -> None:
    app.router.add_post("/api/jobs", submit_job)
    app.router.add_get("/api/jobs", list_jobs)
    app.router.add_get("/api/jobs/{id}", get_job)
    app.router.add_get("/api/jobs/{id}/events", job_events)
    app.router.add_get("/api/jobs/{id}/log", job_log)
    app.router.add_post("/api/jobs/{id}/cancel", cancel_job)
    app.router.add_post("/api/jobs/{id}/resume", resume_job)
    app.router.add_delete("/api/jobs/{id}", delete_job)
    app.router.add_post("/api/datasets", upload_dataset)
    app.router.add_get("/api/dataset/templates", dataset_templates)
    app.router.add_get("/api/gpu", gpu_state)


# ------------------------------------------------------------------ jobs


async def submit_job(request: web.Request) -> web.Response:
    body = await decode_body(request, SubmitBody)
    settings = request.app[JOB_SETTINGS]
    params = validate_params(body.kind, body.params, ResolveContext(settings.roots, settings.model_lookup))
    job, created = await request.app[JOB_RUNNER].submit(body.kind, params, body.priority)
    return json_response(job.to_api(), status=201 if created else 200)


def _int_query(request: web.Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"{name} must be an integer", param=name) from None
    if not lo <= value <= hi:
        raise BadRequest(f"{name} must be within {lo}..{hi}", param=name)
    return value


async def list_jobs(request: web.Request) -> web.Response:
    statuses = [s for s in request.query.get("status", "").split(",") if s]
    bad = [s for s in statuses if s not in _STATUSES]
    if bad:
        raise BadRequest(f"unknown status {bad[0]!r}", param="status")
    page = await request.app[JOB_STORE].list_jobs(
        status=statuses,
        kind=request.query.get("kind") or None,
        limit=_int_query(request, "limit", 50, 1, 500),
        cursor=request.query.get("cursor") or None,
    )
    return json_response(
        {"object": "list", "data": [j.to_api() for j in page.jobs], "next_cursor": page.next_cursor}
    )


async def get_job(request: web.Request) -> web.Response:
    job = await request.app[JOB_STORE].get(request.match_info["id"])
    return json_response(job.to_api())


class CancelBody(msgspec.Struct, forbid_unknown_fields=True):
    # Resumable kinds (finetune): write a checkpoint before stopping.
    save: bool = False


def _cancel_save(request: web.Request, body: bytes) -> bool:
    """``save`` from the query (``?save=true``) or a JSON body ``{"save": true}``."""
    raw = request.query.get("save")
    if raw is not None:
        if raw.lower() not in ("true", "1", "false", "0"):
            raise BadRequest("save must be true or false", param="save")
        return raw.lower() in ("true", "1")
    return decode_json(body, CancelBody).save if body.strip() else False


async def cancel_job(request: web.Request) -> web.Response:
    save = _cancel_save(request, await read_body(request))
    job = await request.app[JOB_RUNNER].cancel(request.match_info["id"], save=save)
    return json_response(job.to_api())


async def resume_job(request: web.Request) -> web.Response:
    """A new attempt of an interrupted, cancelled or failed resumable job,
    from its newest complete checkpoint (same job id, events continue)."""
    job = await request.app[JOB_RUNNER].resume(request.match_info["id"])
    return json_response(job.to_api())


async def delete_job(request: web.Request) -> web.Response:
    job = await request.app[JOB_STORE].delete(request.match_info["id"])
    if job.log_path:
        Path(job.log_path).unlink(missing_ok=True)
    return json_response({"id": job.id, "object": "job", "deleted": True})


async def job_log(request: web.Request) -> web.Response:
    job = await request.app[JOB_STORE].get(request.match_info["id"])
    limit = request.app[JOB_SETTINGS].log_max_bytes
    tail = _int_query(request, "tail", limit, 0, limit)
    data = await asyncio.to_thread(_read_tail, job.log_path, tail) if job.log_path else b""
    return web.Response(body=data, content_type="text/plain", charset="utf-8")


def _read_tail(path: str, max_bytes: int) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            return f.read()
    except FileNotFoundError:
        return b""


# ------------------------------------------------------------------ events (SSE)


def _last_event_id(request: web.Request) -> int:
    raw = request.headers.get("Last-Event-ID") or request.query.get("after") or "0"
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest("Last-Event-ID must be an event sequence number", param="Last-Event-ID") from None
    return max(0, value)


async def job_events(request: web.Request) -> web.StreamResponse:
    """Replay events after Last-Event-ID, then stream live ones; ``end`` last."""
    store = request.app[JOB_STORE]
    settings = request.app[JOB_SETTINGS]
    job_id = request.match_info["id"]
    await store.get(job_id)  # 404 before the stream starts
    last = _last_event_id(request)
    # Subscribe before reading the database so no event falls in between.
    with store.hub.subscribe(job_id) as sub:
        sse = await SseWriter.start(request)
        try:
            await sse.raw(b"retry: %d\n\n" % settings.sse_retry_ms)
            await _stream(sse, store, sub, job_id, last, settings.sse_heartbeat_s)
        except ConnectionError:  # the client went away
            return sse.response
    return sse.response


async def _stream(
    sse: SseWriter, store: JobStore, sub: Subscription, job_id: str, last: int, heartbeat: float
) -> None:
    from_db = True
    while True:
        if from_db:
            batch = await store.events_after(job_id, last, 1000)
            for e in batch:
                await sse.data(e, event=e.type, id=e.seq)
                last = e.seq
            if len(batch) == 1000:
                continue
            from_db = False
            job = await store.get(job_id)
            if job.finished and last >= job.last_seq:
                await sse.data(job.to_api(), event="end", id=last)
                return
        if not await sub.wait(heartbeat):
            await sse.comment("keepalive")
            continue
        lagged, ended = sub.lagged, sub.ended
        for e in sub.take():
            if e.seq <= last:
                continue
            if e.seq != last + 1:
                from_db = True
                break
            await sse.data(e, event=e.type, id=e.seq)
            last = e.seq
        from_db = from_db or lagged or ended


# ------------------------------------------------------------------ datasets


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


async def _file_part(request: web.Request) -> BodyPartReader:
    try:
        reader = await request.multipart()
        # Skipping other fields reads them: a malformed body fails here too.
        while (part := await reader.next()) is not None:
            if isinstance(part, BodyPartReader) and part.name == "file":
                return part
            await part.release()
    except (AssertionError, ValueError, KeyError, BadHttpMessage) as exc:
        raise BadRequest(f"expected a multipart/form-data body: {exc}", param="file") from exc
    raise BadRequest("multipart field 'file' is missing", param="file")


async def upload_dataset(request: web.Request) -> web.Response:
    settings = request.app[JOB_SETTINGS]
    part = await _file_part(request)
    name = _upload_name(part.filename)
    directory = settings.roots.datasets
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".upload-{secrets.token_hex(6)}.tmp"
    size = 0
    try:
        with tmp.open("wb") as f:
            while chunk := await part.read_chunk(1 << 16):
                size += len(chunk)
                if size > settings.max_upload_bytes:
                    raise PayloadTooLarge(
                        f"upload exceeds the limit of {settings.max_upload_bytes} bytes", param="file"
                    )
                f.write(chunk)
        final = _claim_name(tmp, directory, name)
    finally:
        tmp.unlink(missing_ok=True)
    return json_response({"name": final, "bytes": size}, status=201)


async def dataset_templates(request: web.Request) -> web.Response:
    return json_response({"object": "list", "data": TEMPLATES, "file_types": FILE_TYPES})


async def gpu_state(request: web.Request) -> web.Response:
    state = dict(request.app[LEASE].snapshot())
    check = request.app.get(ENGINE_CHECK)
    # An app assembled without the start-up check (a lab-only app) reports it unchecked.
    build = check.build if check is not None else EngineBuild()
    # engine_gpu: false when the machine has GPUs the installed engine cannot use.
    state["engine"] = {**msgspec.structs.asdict(build),
                       "engine_gpu": bool(build.engine_gpus) or build.machine_gpus == 0}
    return json_response(state)
