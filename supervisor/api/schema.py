"""``GET /api/jobs/schema``: the JSON Schema of each job kind's params.

The web UI builds its submit forms from this, so a form offers exactly the
fields, types, defaults and bounds that :func:`jobs.params.validate_params`
enforces, and a kind added to :func:`jobs.params.job_kinds` gets a form
without any UI change.
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from jobs.params import KindSpec, job_kinds
from supervisor.api.io import json_response
from supervisor.appkeys import JOB_SCHEMA_ROUTES

SCHEMA_PATH = "/api/jobs/schema"
# Marks an app whose schema route is registered (add_routes is idempotent).


def kind_schema(spec: KindSpec) -> dict[str, Any]:
    """One kind: its name, description and the params struct's schema.

    The struct's ``$defs`` entry is inlined so a client reads ``schema``
    directly; nested definitions, if any, stay under ``schema["$defs"]``.
    """
    raw = msgspec.json.schema(spec.params)
    defs: dict[str, Any] = dict(raw.get("$defs", {}))
    ref = raw.get("$ref", "")
    name = ref.rsplit("/", 1)[-1]
    schema: dict[str, Any] = dict(defs.pop(name)) if name in defs else dict(raw)
    if defs:
        schema["$defs"] = defs
    return {"kind": spec.name, "description": spec.description, "schema": schema}


def all_schemas() -> dict[str, Any]:
    return {"object": "list", "data": [kind_schema(s) for s in job_kinds().values()]}


async def job_schema(request: web.Request) -> web.Response:
    # The kinds are fixed for the life of the process; the body is cheap to rebuild.
    return json_response(all_schemas(), headers={"Cache-Control": "no-cache"})


def add_routes(app: web.Application) -> None:
    if app.get(JOB_SCHEMA_ROUTES):
        return
    app[JOB_SCHEMA_ROUTES] = True
    app.router.add_get(SCHEMA_PATH, job_schema)
