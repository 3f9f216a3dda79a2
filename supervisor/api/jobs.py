"""HTTP routes of the lab: jobs, their events (SSE) and logs, and the GPU lease
snapshot; the dataset routes are in :mod:`supervisor.api.datasets`.

Jobs are scoped to the key that submitted them: a user key sees only its own
(another key's job is 404) and never a job's process facts (pid, log path);
admins, and everyone with authentication off, see every job in full.

The app must hold :data:`JOB_STORE`, :data:`JOB_RUNNER`, :data:`LEASE` and
:data:`JOB_SETTINGS`; handlers raise :mod:`supervisor.errors` classes and the
app's middleware renders them.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import msgspec
from aiohttp import web

from jobs.errors import ParamError
from jobs.kinds import validate_params
from jobs.params import ModelLookup, ResolveContext, Roots
from supervisor.api import datasets, job_estimate, user_view
from supervisor.api.auth import key_id_of, request_scope
from supervisor.api.io import (
    SseWriter,
    decode_body,
    decode_json,
    json_response,
    read_body,
)
from supervisor.appkeys import (
    ENGINE_CHECK,
    JOB_RUNNER,
    JOB_SETTINGS,
    JOB_STORE,
    LEASE,
)
from supervisor.errors import (
    BadRequest,
    Conflict,
    NotFound,
    param_error,
)
from supervisor.lab.hub import StoredEvent, Subscription
from supervisor.lab.leftovers import remove_job_temps
from supervisor.lab.store import FINISHED, Job, JobStore
from supervisor.models.devices import DeviceReadError, GpuReading
from supervisor.workers.engine_check import EngineBuild

_STATUSES = frozenset({"queued", "running", *FINISHED})
# Event fields that are process facts of the machine: for admins only.
_ADMIN_EVENT_FIELDS = ("pid", "log_path")


@dataclass(frozen=True)
class JobSettings:
    roots: Roots
    max_upload_bytes: int = 1 << 30
    sse_heartbeat_s: float = 15.0
    sse_retry_ms: int = 2000
    log_max_bytes: int = 1 << 20
    # Maps a model id from /v1/models to its GGUF file (the model library).
    model_lookup: ModelLookup | None = None
    # Offer the test-only job kinds (the test_job_kinds setting).
    test_job_kinds: bool = False


class SubmitBody(msgspec.Struct, forbid_unknown_fields=True):
    kind: str
    params: dict[str, Any] = {}
    priority: Annotated[int, msgspec.Meta(ge=-1000, le=1000)] = 0


def add_routes(app: web.Application) -> None:
    app.router.add_post("/api/jobs", submit_job)
    app.router.add_get("/api/jobs", list_jobs)
    job_estimate.add_routes(app)
    # Before /api/jobs/{id}, which would take "nodes" as a job id.
    app.router.add_get("/api/jobs/nodes", job_nodes)
    app.router.add_get("/api/jobs/{id}", get_job)
    app.router.add_get("/api/jobs/{id}/events", job_events)
    app.router.add_get("/api/jobs/{id}/log", job_log)
    app.router.add_post("/api/jobs/{id}/cancel", cancel_job)
    app.router.add_post("/api/jobs/{id}/resume", resume_job)
    app.router.add_delete("/api/jobs/{id}", delete_job)
    datasets.add_routes(app)
    app.router.add_get("/api/gpu", gpu_state)


# ------------------------------------------------------------------ jobs


@dataclass(frozen=True)
class Caller:
    """Whose jobs a request may see, and the owner recorded on jobs it submits."""

    # Key id, "admin" (admin token or session), or None with authentication off.
    owner: str | None
    # Admins and everyone with authentication off see every job.
    sees_all: bool

    def may_see(self, job: Job) -> bool:
        return self.sees_all or (self.owner is not None and job.owner == self.owner)

    def view(self, job: Job) -> dict[str, Any]:
        shown = job.to_api(admin=self.sees_all)
        return shown if self.sees_all else user_view.job(shown)


def caller(request: web.Request) -> Caller:
    """Who asks, as the auth middleware admitted them (it verified the key)."""
    # The middleware names every principal it admits; no name: auth is off.
    if "auth_name" not in request:
        return Caller(None, True)
    scope = request_scope(request)
    if scope is not None:  # a user key: it sees its own jobs only
        return Caller(scope, False)
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    key_id = key_id_of(token.strip()) if scheme.lower() == "bearer" else None
    return Caller(key_id or "admin", True)


async def _visible_job(request: web.Request, who: Caller) -> Job:
    """The job in the path; another key's job is 404, as a missing one is."""
    job_id = request.match_info["id"]
    job = await request.app[JOB_STORE].get(job_id)
    if not who.may_see(job):
        raise NotFound(f"no job with id {job_id!r}", param="id")
    return job


async def submit_job(request: web.Request) -> web.Response:
    body = await decode_body(request, SubmitBody)
    who = caller(request)
    settings = request.app[JOB_SETTINGS]
    ctx = ResolveContext(settings.roots, settings.model_lookup, test_kinds=settings.test_job_kinds)
    try:
        params = validate_params(body.kind, body.params, ctx)
        # Devices the machine lacks (gpus, gpu_ids) are a 400 now, not a failed job later.
        params.devices(request.app[LEASE].devices)
    except ParamError as exc:
        raise param_error(exc) from exc
    job, created = await request.app[JOB_RUNNER].submit(body.kind, params, body.priority, who.owner)
    if not who.may_see(job):
        # Deduplicated onto another key's job: say so without showing it.
        raise Conflict("an identical job is already queued or running")
    return json_response(who.view(job), status=201 if created else 200)


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
    who = caller(request)
    page = await request.app[JOB_STORE].list_jobs(
        status=statuses,
        kind=request.query.get("kind") or None,
        limit=_int_query(request, "limit", 50, 1, 500),
        cursor=request.query.get("cursor") or None,
        owner=None if who.sees_all else who.owner,
    )
    return json_response(
        {"object": "list", "data": [who.view(j) for j in page.jobs], "next_cursor": page.next_cursor}
    )


async def job_nodes(request: web.Request) -> web.Response:
    """The cluster nodes a job may name in ``node`` (the new-job form's choice):
    the alive ones, each with the devices the lease books there (none for a
    node without logical GPUs, which still runs jobs that book none)."""
    alive = await request.app[JOB_RUNNER].alive_nodes("for the jobs that name one")
    lease = request.app[LEASE]
    data = [{"object": "job.node", "name": name,
             "devices": [d for d in lease.devices if lease.device(d).node == name]}
            for name in alive or []]
    return json_response({"object": "list", "cluster": alive is not None, "data": data})


async def get_job(request: web.Request) -> web.Response:
    who = caller(request)
    return json_response(who.view(await _visible_job(request, who)))


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
    who = caller(request)
    job = await _visible_job(request, who)
    job = await request.app[JOB_RUNNER].cancel(job.id, save=save)
    return json_response(who.view(job))


async def resume_job(request: web.Request) -> web.Response:
    """A new attempt of an interrupted, cancelled or failed resumable job,
    from its newest complete checkpoint (same job id, events continue)."""
    who = caller(request)
    job = await _visible_job(request, who)
    job = await request.app[JOB_RUNNER].resume(job.id)
    return json_response(who.view(job))


async def delete_job(request: web.Request) -> web.Response:
    who = caller(request)
    job = await _visible_job(request, who)
    job = await request.app[JOB_STORE].delete(job.id)
    if job.log_path:
        Path(job.log_path).unlink(missing_ok=True)
    # A job killed mid-write leaves its temp files; a deleted job keeps none.
    await asyncio.to_thread(remove_job_temps, request.app[JOB_SETTINGS].roots.all(), {job.id})
    return json_response({"id": job.id, "object": "job", "deleted": True})


async def job_log(request: web.Request) -> web.Response:
    job = await _visible_job(request, caller(request))
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
    who = caller(request)
    job_id = (await _visible_job(request, who)).id  # 404 before the stream starts
    last = _last_event_id(request)
    # Subscribe before reading the database so no event falls in between.
    with store.hub.subscribe(job_id) as sub:
        sse = await SseWriter.start(request)
        try:
            await sse.raw(b"retry: %d\n\n" % settings.sse_retry_ms)
            await _stream(sse, store, sub, job_id, last, settings.sse_heartbeat_s, who)
        except ConnectionError:  # the client went away
            return sse.response
    return sse.response


def _event_view(e: StoredEvent, who: Caller) -> StoredEvent:
    if who.sees_all or not any(k in e.data for k in _ADMIN_EVENT_FIELDS):
        return e
    data = {k: v for k, v in e.data.items() if k not in _ADMIN_EVENT_FIELDS}
    return StoredEvent(e.seq, e.time, e.type, data)


async def _stream(
    sse: SseWriter, store: JobStore, sub: Subscription, job_id: str, last: int, heartbeat: float,
    who: Caller,
) -> None:
    from_db = True
    while True:
        if from_db:
            batch = await store.events_after(job_id, last, 1000)
            for e in batch:
                await sse.data(_event_view(e, who), event=e.type, id=e.seq)
                last = e.seq
            if len(batch) == 1000:
                continue
            from_db = False
            job = await store.get(job_id)
            if job.finished and last >= job.last_seq:
                await sse.data(who.view(job), event="end", id=last)
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
            await sse.data(_event_view(e, who), event=e.type, id=e.seq)
            last = e.seq
        from_db = from_db or lagged or ended


async def gpu_state(request: web.Request) -> web.Response:
    lease = request.app[LEASE]
    memory: list[GpuReading] = []
    memory_error = None
    if lease.settler is not None and lease.gpu_indices(lease.devices):
        try:
            # Memory per GPU as the driver reports it now (a blocking read: in a thread).
            memory = await lease.settler.read()
        except DeviceReadError as exc:
            memory_error = str(exc)
    state = dict(lease.snapshot(memory))
    state["memory_error"] = memory_error
    scope = request_scope(request)
    if scope is not None:  # a user key: other callers' jobs unnamed
        state = await user_view.gpu(state, scope, user_view.owner_reader(request.app[JOB_STORE].get))
    check = request.app.get(ENGINE_CHECK)
    # An app assembled without the start-up check (a lab-only app) reports it unchecked.
    build = check.build if check is not None else EngineBuild()
    # engine_gpu: false when the machine has GPUs the installed engine cannot use.
    state["engine"] = {**msgspec.structs.asdict(build),
                       "engine_gpu": bool(build.engine_gpus) or build.machine_gpus == 0}
    return json_response(state)
