"""Who a request counts against: the caller that per-caller limits key on.

The API key the request came with (by its public id; the admin token is one
caller, and so is each key of a deployment without an admin token), or the client's address when authentication is off (behind a
trusted proxy, the forwarded one; an IPv6 address by its /64). Model
workers blame crashes on callers (supervisor/workers/crash_keys.py).
"""

from __future__ import annotations

from aiohttp import web

from supervisor.api.auth import request_scope
from supervisor.api.proxies import client_key


def caller_of(request: web.Request) -> str:
    """``key <id>``, ``name <name>`` or ``address <client>``: never a secret."""
    scope = request_scope(request)
    if scope is not None:
        return f"key {scope}"
    name = request.get("auth_name")
    if isinstance(name, str):
        # The admin token ("admin"), or a key of a keys-only deployment (each an admin).
        return f"name {name}"
    return f"address {client_key(request.remote or '')}"
