"""``GET /api/jobs/schema``: the JSON Schema of each job kind's params.

The web UI builds its submit forms from this, so a form offers exactly the
fields, types, defaults and bounds that :func:`jobs.kinds.validate_params`
enforces, and a kind added to :func:`jobs.kinds.job_kinds` gets a form
without any UI change. Each kind says whether it can run here
(``available``, ``unavailable_reason``) so the UI explains before submit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
from aiohttp import web

from jobs.finetune_params import missing_train_modules, train_missing_reason
from jobs.kinds import KindSpec, job_kinds
from supervisor.api.io import json_response
from supervisor.appkeys import JOB_SCHEMA_ROUTES, JOB_SETTINGS

SCHEMA_PATH = "/api/jobs/schema"
# Marks an app whose schema route is registered (add_routes is idempotent).


def kind_schema(spec: KindSpec, missing_train: Sequence[str] = ()) -> dict[str, Any]:
    """One kind: its name, description, availability and the params struct's schema.

    ``missing_train``: the train extra's modules that are not installed.
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
    reason = train_missing_reason(spec.name, missing_train) if spec.needs_train and missing_train else ""
    return {"kind": spec.name, "description": spec.description, "available": not reason,
            "unavailable_reason": reason, "schema": schema}


def all_schemas(*, include_test: bool = False, missing_train: Sequence[str] = ()) -> dict[str, Any]:
    kinds = job_kinds(include_test).values()
    return {"object": "list", "data": [kind_schema(s, missing_train) for s in kinds]}


async def job_schema(request: web.Request) -> web.Response:
    # Rebuilt per request (cheap), so the train extra is looked up each time.
    settings = request.app.get(JOB_SETTINGS)
    include_test = settings is not None and settings.test_job_kinds
    body = all_schemas(include_test=include_test, missing_train=missing_train_modules())
    return json_response(body, headers={"Cache-Control": "no-cache"})


def add_routes(app: web.Application) -> None:
    if app.get(JOB_SCHEMA_ROUTES):
        return
    app[JOB_SCHEMA_ROUTES] = True
    app.router.add_get(SCHEMA_PATH, job_schema)
