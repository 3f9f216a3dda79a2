"""The OpenAI Responses API (``/v1/responses``) with stored responses: the
service, its store, events, items and objects, and background runs.

The HTTP layer is apart (supervisor/api/responses.py), and this package does
not import it: the routes import the service, never the other way round.
Wiring, in the app factory::

    MIGRATIONS = [JOBS_SCHEMA, responses.RESPONSES_SCHEMA, ...,
                  responses.RESPONSE_EVENTS_SCHEMA]          # append only
    ...
    app.cleanup_ctx.extend([db_ctx, ..., ctx_that_sets_POOL])
    routes_responses.setup(app, retention_s=..., keepalive_s=...)    # after those

``RESPONSE_EVENTS_SCHEMA`` (the events of background responses) is also
applied by the store at start, idempotently, so a database whose migration
list does not carry it yet still gets the table.
"""

from __future__ import annotations

from supervisor.responses.store import RESPONSE_EVENTS_SCHEMA, RESPONSES_SCHEMA

__all__ = ["RESPONSES_SCHEMA", "RESPONSE_EVENTS_SCHEMA"]
