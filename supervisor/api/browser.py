"""Browser safety for every route: JSON routes take only JSON bodies, and
every response carries security headers."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

from aiohttp import web

from supervisor.appkeys import CONFIG
from supervisor.errors import ApiError, PayloadTooLarge

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
# /v1 and /api routes whose body is not JSON (multipart uploads).
NON_JSON_BODIES = frozenset({"/api/datasets", "/v1/files"})
# The same, for routes with an id in their path (a container's file upload).
NON_JSON_PATHS = re.compile(r"/v1/containers/[^/]+/files")

# ``same-origin``, not ``no-referrer``: under no-referrer a browser sends
# ``Origin: null`` on the sign-in form's POST (and on the UI's own fetches),
# which the CSRF check cannot tell from a forged one. same-origin keeps our
# own origin in those requests and still sends nothing to other sites.
REFERRER_POLICY = "same-origin"

SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": REFERRER_POLICY,
    "X-Frame-Options": "DENY",
    "Cross-Origin-Opener-Policy": "same-origin",
    # No inline scripts or styles anywhere in the UI.
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; "
    "frame-ancestors 'none'; form-action 'self'",
}


class UnsupportedMediaType(ApiError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


@web.middleware
async def require_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A JSON route's body must be declared application/json: a page can POST
    text/plain or a form to any site without asking, but never JSON. A body
    declared over the limit is refused for its size first (413, unread)."""
    if (request.method not in BODY_METHODS or not request.path.startswith(("/v1/", "/api/"))
            or request.path in NON_JSON_BODIES or NON_JSON_PATHS.fullmatch(request.path)
            or not request.body_exists):
        return await handler(request)
    limit = request.app[CONFIG].max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
    if request.content_type != "application/json":
        raise UnsupportedMediaType(
            f"this route takes a JSON body with Content-Type: application/json, not {request.content_type!r}")
    return await handler(request)


async def security_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: also reaches streamed and error responses."""
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)

