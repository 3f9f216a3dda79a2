"""``/v1/containers``: code_interpreter containers as OpenAI's containers
API has them (create, list, retrieve, delete); their files are
container_files.py's.

A container made here is the same as one a response makes with
``container: {"type": "auto"}``: a folder in the service's pool
(supervisor/sandbox/containers.py), named by its id in a later
code_interpreter tool (``container: "cntr_..."``), with the files it was
given there. It belongs to the key that made it (another key gets a 404),
counts against ``code_interpreter_max_containers`` and expires after
``expires_after.minutes`` idle, at most ``code_interpreter_idle_s``: a
container never outlives what the service allows. Off (no pool), making one
is a 400 that says why, and there is none to list.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from aiohttp import web

from supervisor.api.auth import request_scope
from supervisor.api.container_files import add_routes as add_file_routes
from supervisor.api.container_files import container_of, page_of, pool_of
from supervisor.api.io import decode_body, json_response
from supervisor.appkeys import KNOWLEDGE, RESPONSES
from supervisor.errors import BadRequest, Conflict
from supervisor.knowledge.records import page_body
from supervisor.responses.hosted.code_interpreter import (
    MAX_INPUT_FILES,
    MEMORY_LIMITS_MIB,
    input_files,
)
from supervisor.sandbox.containers import (
    Container,
    ContainerPool,
    PoolFull,
    remove_tree,
)
from supervisor.sandbox.files import copy_in

MAX_NAME_CHARS = 256


class ExpiresAfter(msgspec.Struct, forbid_unknown_fields=True):
    """OpenAI's: the container expires this many minutes after its last use."""

    anchor: Literal["last_active_at"]
    minutes: Annotated[int, msgspec.Meta(ge=1)]


class NetworkPolicy(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["disabled", "allowlist"]
    allowed_domains: list[str] | None = None


class CreateContainer(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # Required, as OpenAI has it; checked by hand so the 400 names it (the decoder's does not).
    name: Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)] | None = None
    file_ids: Annotated[list[str], msgspec.Meta(max_length=MAX_INPUT_FILES)] = []
    expires_after: ExpiresAfter | None = None
    memory_limit: Literal["1g", "4g", "16g", "64g"] | None = None
    network_policy: NetworkPolicy | None = None
    # Accepted in shape only to be refused by name: no skills run here.
    skills: Annotated[list[Any], msgspec.Meta(max_length=0)] = []


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/containers", create_container)
    app.router.add_get("/v1/containers", list_containers)
    app.router.add_get("/v1/containers/{container_id}", retrieve_container)
    app.router.add_delete("/v1/containers/{container_id}", delete_container)
    add_file_routes(app)


def container_object(pool: ContainerPool, container: Container) -> dict[str, Any]:
    """The SDK's ``ContainerCreateResponse`` (and retrieve's, and list's)."""
    memory = next((k for k, v in MEMORY_LIMITS_MIB.items() if v == container.memory_mib), None)
    return {"id": container.id, "object": "container", "name": container.name, "created_at": container.created_at,
            "status": "running", "last_active_at": pool.last_active_at(container),
            "expires_after": {"anchor": "last_active_at", "minutes": math.ceil(pool.idle_s_of(container) / 60)},
            "memory_limit": memory, "network_policy": {"type": "disabled"}}


def _pool_or_refuse(request: web.Request) -> ContainerPool:
    pool = pool_of(request)
    if pool is None:
        raise BadRequest(request.app[RESPONSES].containers.unavailable, code="hosted_tool_unavailable")
    return pool


def _idle_s(pool: ContainerPool, expires: ExpiresAfter | None) -> float | None:
    if expires is None:
        return None
    most = max(1, int(pool.idle_s // 60))
    if expires.minutes > most:
        raise BadRequest(f"expires_after.minutes may be at most {most} here (code_interpreter_idle_s is "
                         f"{pool.idle_s:g} s)", param="expires_after.minutes")
    return expires.minutes * 60.0


async def create_container(request: web.Request) -> web.Response:
    pool = _pool_or_refuse(request)
    req = await decode_body(request, CreateContainer)
    if req.name is None:
        raise BadRequest("name is required", param="name")
    if req.network_policy is not None and req.network_policy.type != "disabled":
        raise BadRequest("the sandbox has no network here; network_policy may only be {\"type\": \"disabled\"}",
                         param="network_policy.type")
    idle_s = _idle_s(pool, req.expires_after)
    scope = request_scope(request)
    # The files are checked before the container is made: a refusal leaves none behind.
    inputs: list[tuple[str, Path]] = []
    if req.file_ids:
        knowledge = request.app.get(KNOWLEDGE)
        if knowledge is None:
            raise BadRequest("files are not available on this server", param="file_ids")
        inputs = await input_files(req.file_ids, knowledge.files, scope, pool.max_upload_bytes, "file_ids")
    try:
        container = pool.create(scope, name=req.name, idle_s=idle_s,
                                memory_mib=MEMORY_LIMITS_MIB[req.memory_limit] if req.memory_limit else None)
    except PoolFull as exc:
        raise Conflict(str(exc), code="too_many_containers") from exc
    try:
        await asyncio.to_thread(copy_in, container, inputs, pool.owner_ids())
    except BaseException:
        pool.remove(container.id)  # half filled: not kept
        raise
    return json_response(container_object(pool, container))


async def list_containers(request: web.Request) -> web.Response:
    pool = pool_of(request)
    name = request.query.get("name")
    if name is not None and len(name) > MAX_NAME_CHARS:
        raise BadRequest(f"name is over {MAX_NAME_CHARS} characters", param="name")
    found = [] if pool is None else [c for c in pool.visible(request_scope(request))
                                     if name is None or c.name == name]
    page, limit = page_of(request.query, found, "id")
    return json_response(page_body([container_object(pool, c) for c in page if pool is not None], limit))


async def retrieve_container(request: web.Request) -> web.Response:
    container = container_of(request)
    pool = pool_of(request)
    assert pool is not None
    return json_response(container_object(pool, container))


async def delete_container(request: web.Request) -> web.Response:
    container = container_of(request)
    pool = pool_of(request)
    assert pool is not None
    if container.lock.locked():
        raise Conflict(f"container {container.id} is running code; delete it when the run ends",
                       param="container_id", code="container_running")
    pool.detach(container.id)
    await asyncio.to_thread(remove_tree, container.path)
    return json_response({"id": container.id, "object": "container.deleted", "deleted": True})
