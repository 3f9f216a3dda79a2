"""The OpenAI Responses API (``/v1/responses``) with stored responses.

Wiring, in the app factory::

    MIGRATIONS = [JOBS_SCHEMA, responses.RESPONSES_SCHEMA, ...,
                  responses.RESPONSE_EVENTS_SCHEMA]          # append only
    ...
    app.cleanup_ctx.extend([db_ctx, ..., ctx_that_sets_POOL])
    responses.setup(app, retention_s=..., keepalive_s=...)    # after those

``RESPONSE_EVENTS_SCHEMA`` (the events of background responses) is also
applied by the store at start, idempotently, so a database whose migration
list does not carry it yet still gets the table.

``setup`` adds the routes, the ``RESPONSES`` state and a cleanup context that
starts after the database and the pool and stops (cancelling background
responses) before them.
"""

from __future__ import annotations

from aiohttp import web

from supervisor.api.responses import add_routes
from supervisor.appkeys import RESPONSES
from supervisor.responses.background import (
    DEFAULT_PRUNE_INTERVAL_S,
    DEFAULT_RETENTION_S,
)
from supervisor.responses.lifecycle import ResponsesApi
from supervisor.responses.service import DEFAULT_KEEPALIVE_S
from supervisor.responses.store import RESPONSE_EVENTS_SCHEMA, RESPONSES_SCHEMA

__all__ = ["RESPONSES", "RESPONSES_SCHEMA", "RESPONSE_EVENTS_SCHEMA", "ResponsesApi", "add_routes", "setup"]


def setup(
    app: web.Application,
    *,
    retention_s: float = DEFAULT_RETENTION_S,
    prune_interval_s: float = DEFAULT_PRUNE_INTERVAL_S,
    keepalive_s: float = DEFAULT_KEEPALIVE_S,
) -> ResponsesApi:
    """Add the routes, the ``RESPONSES`` state and its cleanup context."""
    api = ResponsesApi(retention_s=retention_s, prune_interval_s=prune_interval_s, keepalive_s=keepalive_s)
    app[RESPONSES] = api
    add_routes(app)
    app.cleanup_ctx.append(api.context)
    return api
