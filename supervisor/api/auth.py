"""Authentication and browser safety.

- API keys (``Authorization: Bearer gv_<id>_<secret>``) for ``/v1/*``: each has
  a name; only a salted scrypt hash is stored, in the database (added and
  revoked with ``gpuvisor keys``) or in config (``api_keys``). The public id
  selects the one hash to check, so a request costs one scrypt at most, and a
  verified key is remembered (as a digest) for later requests. A token with
  no known id (or of no known shape) is refused without hashing.
- An admin token for ``/api/*`` mutations and the UI (bearer, or a session
  cookie set by ``POST /login``). Without an admin token, API keys are admins.
  A hashed admin token is checked only against tokens of its shape
  (``gva_<id>_<secret>``, made by ``gpuvisor keys admin-token``) and with its
  id: the hash carries the token's public id (``scrypt$...$<id>``), so an
  unknown admin-shaped token costs no scrypt either. A hash of the older form
  (no id) is checked against any admin-shaped token until the first success
  (each failure spends the client's budget), then only against its id.
- Failed authentications are budgeted per client address (``auth_failure_*``):
  over budget, 429 with Retry-After, and nothing is hashed for that client.
- ``/healthz``, ``/readyz`` and ``/login`` stay open; with authentication on,
  the probes tell an anonymous caller only ok / not ok.
- Authentication, once configured, stays on (``auth`` setting): revoking the
  last key refuses protected routes rather than opening them. Off (nothing
  configured, or ``auth = "off"``) on a non-loopback address without
  ``allow_unauthenticated``, every request is refused (503).
- State-changing requests from a browser must come from our own origin
  (CSRF), and JSON routes take only ``application/json`` bodies (a page
  cannot send those cross-site without a CORS preflight); every response
  carries security headers.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import msgspec
from aiohttp import web
from aiohttp.typedefs import Middleware

from supervisor.api.browser import Handler, require_json, security_headers
from supervisor.api.failures import FailureLimiter, TooManyRequests
from supervisor.api.io import json_response
from supervisor.api.keys import (
    ADMIN_PREFIX,
    AUTH_SCHEMA,
    KeyRecord,
    KeyStore,
    hash_secret,
    hashed_id,
    key_id_of,
    new_api_key,
    parse_config_keys,
    token_digest,
    verify_secret,
)
from supervisor.api.login import SESSION_COOKIE, add_routes
from supervisor.api.proxies import is_loopback_host
from supervisor.appkeys import AUTH, DB
from supervisor.config import AuthMode, Config
from supervisor.errors import ApiError, Unauthorized

# What the app, the CLI and the tests use of authentication, wherever it lives.
__all__ = [
    "ADMIN", "AUTH_SCHEMA", "Auth", "FailureLimiter", "KeyRecord", "KeyStore", "Principal", "TooManyRequests",
    "add_routes", "hash_secret", "hashed_id", "key_id_of", "keys_ctx", "new_api_key", "parse_config_keys",
    "request_scope", "require_json", "security_headers", "verify_secret",
]

Role = Literal["user", "admin"]
# Request key: the API key id whose own stored objects the caller may use; None = all.
SCOPE = "auth_scope"


def request_scope(request: web.Request) -> str | None:
    """The key id a request is scoped to (a user key), or None (admin, or auth off)."""
    scope = request.get(SCOPE)
    return scope if isinstance(scope, str) else None


SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/login"})
PROBE_PATHS = frozenset({"/healthz", "/readyz"})
# Ours are ~55 characters; a longer bearer is no credential of ours.
MAX_TOKEN_CHARS = 256

log = logging.getLogger("gpuvisor.auth")


class Forbidden(ApiError):
    status = 403
    type = "permission_error"
    code = "forbidden"


class OpenlyExposed(ApiError):
    """Authentication is off on a non-loopback address (503; waiting won't fix it)."""

    status = 503
    type = "server_error"
    code = "authentication_not_configured"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"x-should-retry": "false"})


# ---------------------------------------------------------------- the gate


@dataclass(frozen=True)
class Principal:
    name: str
    role: Role
    # The API key's public id (None for the admin): what a user's stored responses belong to.
    key_id: str | None = field(default=None, compare=False)


ADMIN = Principal("admin", "admin")


@dataclass(frozen=True)
class _Candidate:
    """The one stored hash a token could match: found without hashing."""

    slot: str  # key id, or "admin"
    stored: str
    who: Principal


class Auth:
    """Who is calling, and may they? Owns the verified-key cache, sessions and
    the failure budget."""

    def __init__(self, store: KeyStore | None, config_keys: dict[str, KeyRecord], admin_token: str,
                 allowed_origins: Sequence[str] = (), clock: Callable[[], float] = time.monotonic,
                 enabled_ttl: float = 1.0, session_ttl: float = 12 * 3600, mode: AuthMode = "auto",
                 bind_host: str = "127.0.0.1", allow_unauthenticated: bool = False,
                 failures: FailureLimiter | None = None) -> None:
        self.store = store
        self.config_keys = config_keys
        self.admin_token = admin_token
        self.allowed_origins = frozenset(o.rstrip("/") for o in allowed_origins)
        self.clock = clock
        self.enabled_ttl = enabled_ttl
        self.session_ttl = session_ttl
        self.mode = mode
        self.bind_host = bind_host
        # Serving without authentication here would open the service to the network.
        self.exposed = not is_loopback_host(bind_host) and not allow_unauthenticated
        self.failures = failures or FailureLimiter(clock=clock)
        self._verified: dict[str, bytes] = {}  # key id (or "admin") -> sha256 of the presented secret
        self._sessions: dict[str, float] = {}  # session id -> expiry
        # The hashed admin token's id: carried by its hash, else learnt at its first success.
        self._admin_id: str | None = hashed_id(admin_token) if admin_token.startswith("scrypt$") else None
        # scrypt verifications made: a test reads it to see what a token cost.
        self.hash_checks = 0
        self._enabled_at = -enabled_ttl
        self._db_keys_ever = False
        self._active_at = -enabled_ttl
        self._db_keys_active = False

    @classmethod
    def from_config(cls, cfg: Config) -> Auth:
        return cls(None, parse_config_keys(cfg.api_keys), cfg.admin_token, cfg.allowed_origins,
                   mode=cfg.auth, bind_host=cfg.host, allow_unauthenticated=cfg.allow_unauthenticated,
                   failures=FailureLimiter(cfg.auth_failure_limit, cfg.auth_failure_window))

    async def enabled(self) -> bool:
        if self.mode != "auto":
            return self.mode == "on"
        if self.admin_token or self.config_keys or self._db_keys_ever:
            return True  # once seen, a stored key keeps auth on for good (rows are never deleted)
        if self.store is None:
            return False
        now = self.clock()
        if now - self._enabled_at >= self.enabled_ttl:
            # Cached briefly: keys added by the CLI take effect within the TTL.
            self._db_keys_ever = await self.store.any_ever()
            self._enabled_at = now
        return self._db_keys_ever

    async def any_credential(self) -> bool:
        """Some admin token or active key exists (else nobody can get in)."""
        if self.admin_token or self.config_keys:
            return True
        if self.store is None:
            return False
        now = self.clock()
        if now - self._active_at >= self.enabled_ttl:
            self._db_keys_active = await self.store.any_active()
            self._active_at = now
        return self._db_keys_active

    def _plain_admin(self, token: str) -> bool:
        if not self.admin_token or self.admin_token.startswith("scrypt$"):
            return False
        # Digests of equal length: no timing leak of the token or its length.
        return hmac.compare_digest(token_digest(token), token_digest(self.admin_token))

    def _admin_candidate(self, token: str) -> _Candidate | None:
        token_id = key_id_of(token, ADMIN_PREFIX)
        if not self.admin_token.startswith("scrypt$") or token_id is None:
            return None  # not of the admin token's shape: no scrypt for it
        if self._admin_id is not None and token_id != self._admin_id:
            return None  # not the admin token's id: no scrypt for it
        return _Candidate("admin", self.admin_token, ADMIN)

    async def _candidate(self, token: str) -> _Candidate | None:
        key_id = key_id_of(token)
        if key_id is None:
            return self._admin_candidate(token)
        record = self.config_keys.get(key_id)
        if record is None and self.store is not None:
            record = await self.store.lookup(key_id)
        if record is None:
            return None  # an id nobody holds: refused without hashing
        return _Candidate(key_id, record.hash,
                          Principal(record.name, "user" if self.admin_token else "admin", key_id))

    def _failed(self, client: str) -> None:
        self.failures.check(client)  # over budget: 429 rather than 401
        self.failures.record(client)

    async def _verify(self, candidate: _Candidate | None, token: str, client: str) -> Principal | None:
        """At most one scrypt; none for a client over its failure budget."""
        if candidate is None or len(token) > MAX_TOKEN_CHARS:
            self._failed(client)
            return None
        digest = token_digest(token)
        known = self._verified.get(candidate.slot)
        if known is not None and hmac.compare_digest(known, digest):
            return candidate.who  # verified before: no hashing, and no budget needed
        self.failures.check(client)
        self.hash_checks += 1
        if not await asyncio.to_thread(verify_secret, token, candidate.stored):
            self._failed(client)
            return None
        self._verified[candidate.slot] = digest
        if candidate.slot == "admin":
            self._admin_id = key_id_of(token, ADMIN_PREFIX)
        return candidate.who

    async def check_admin_token(self, token: str, client: str = "") -> bool:
        if self._plain_admin(token):
            return True
        return await self._verify(self._admin_candidate(token), token, client) is not None

    async def identify_bearer(self, token: str, client: str = "") -> Principal | None:
        """The caller behind ``token``, or None. Raises TooManyRequests for a
        client over its failure budget (unless its token was verified before)."""
        if self._plain_admin(token):
            return ADMIN
        candidate = await self._candidate(token) if len(token) <= MAX_TOKEN_CHARS else None
        return await self._verify(candidate, token, client)

    def new_session(self) -> str:
        now = self.clock()
        for sid in [s for s, exp in self._sessions.items() if exp <= now]:
            del self._sessions[sid]
        sid = secrets.token_urlsafe(32)
        self._sessions[sid] = now + self.session_ttl
        return sid

    def end_session(self, sid: str) -> None:
        self._sessions.pop(sid, None)

    def session_valid(self, sid: str) -> bool:
        expiry = self._sessions.get(sid)
        return expiry is not None and expiry > self.clock()

    async def identify(self, request: web.Request) -> Principal | None:
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return await self.identify_bearer(token.strip(), request.remote or "")
        sid = request.cookies.get(SESSION_COOKIE)
        if sid and self.session_valid(sid):
            return Principal("admin-session", "admin")
        return None

    # ------------------------------------------------------------ policy

    def check_origin(self, request: web.Request) -> None:
        """CSRF: cookies are ambient, so a cross-site state change is refused.
        A request with an Authorization header cannot be forged by a page.

        ``Sec-Fetch-Site`` is set by the browser and no page can forge it, so
        where it is present it decides: ``same-origin`` passes (whatever the
        Origin says: ``null`` too, as sent under a strict referrer policy, and
        a proxy that rewrote Host does not matter, since the browser compared
        the origins it saw); ``same-site`` (a sibling port or subdomain) and
        ``cross-site`` are refused unless the Origin is an allowed one.
        Without the header (an older browser, a non-browser client) a present
        Origin must be ours or an allowed one, and ``null`` is refused."""
        if request.method in SAFE_METHODS or "Authorization" in request.headers:
            return
        origin = request.headers.get("Origin")
        site = request.headers.get("Sec-Fetch-Site")
        if site in ("same-origin", "none"):  # none: the user's own navigation
            return
        if origin is not None and origin.rstrip("/") in self.allowed_origins:
            return
        if site is not None:
            raise Forbidden(f"{site} request refused: only this service's own pages may change state",
                            code="csrf_origin")
        own = f"{request.scheme}://{request.host}"
        if origin is not None and origin.rstrip("/") != own:
            raise Forbidden(f"request from origin {origin!r} refused (expected {own})",
                            code="csrf_origin")

    @staticmethod
    def required_role(request: web.Request) -> Role | None:
        path = request.path
        # The UI's own files hold no data (the same in every install), and the
        # sign-in page needs its stylesheet before anyone has signed in.
        if path in OPEN_PATHS or path.startswith("/static/"):
            return None
        # Any key may read the API description: clients generate code from it.
        if path.startswith("/v1/") or path in ("/metrics", "/openapi.json"):
            return "user"
        # A worker's log shows file paths and native stacks: for the operator only.
        if path.startswith("/api/models/") and path.endswith("/log"):
            return "admin"
        if path.startswith("/api/"):
            return "user" if request.method in SAFE_METHODS else "admin"
        return "admin"  # the UI

    async def _probe(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """An open probe: details (workers, pids, failure reasons) only for
        a caller who is signed in; anyone else learns ok or not ok."""
        resp = await handler(request)
        try:
            who = await self.identify(request)
        except TooManyRequests:
            who = None  # over budget: answered as anonymous, never with 429
        if who is not None:
            return resp
        ok = resp.status < 400
        if request.path == "/readyz":
            return json_response({"ready": ok}, status=resp.status)
        return json_response({"status": _health_word(resp) if ok else "error"}, status=resp.status)

    def _refuse_exposed(self) -> OpenlyExposed:
        if self.mode == "off":
            why, fix = 'auth = "off" is set', 'remove auth = "off"'
        else:
            why, fix = "no admin token or API key is configured", "add a key (gpuvisor keys add NAME)"
        return OpenlyExposed(
            f"refusing to serve: {why} and this service listens on {self.bind_host}, where anyone "
            f"who can reach it could use it; {fix}, or set allow_unauthenticated = true on a network "
            "you trust completely")

    async def _unauthorized(self) -> Unauthorized:
        message = "missing or invalid API key: send 'Authorization: Bearer <key>'"
        if not await self.any_credential():
            message = ("authentication is on but no admin token or API key is active (the last one "
                       "was revoked): add one with `gpuvisor keys add NAME`, or set auth = \"off\" "
                       "to serve without authentication")
        return Unauthorized(message, headers={"WWW-Authenticate": 'Bearer realm="gpuvisor"'})

    def middleware(self) -> Middleware:
        @web.middleware
        async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
            self.check_origin(request)
            if not await self.enabled():
                if self.exposed:
                    raise self._refuse_exposed()
                return await handler(request)
            need = self.required_role(request)
            if need is None:
                return await (self._probe(request, handler) if request.path in PROBE_PATHS
                              else handler(request))
            who = await self.identify(request)
            if who is None:
                if request.path == "/" and "text/html" in request.headers.get("Accept", ""):
                    return web.Response(status=303, headers={"Location": "login"})
                raise await self._unauthorized()
            if need == "admin" and who.role != "admin":
                raise Forbidden(f"key {who.name!r} may not do this: it needs the admin token")
            request["auth_name"] = who.name
            # A user key sees only what it stored (responses); the admin sees all.
            request[SCOPE] = who.key_id if who.role == "user" else None
            return await handler(request)

        return middleware


def _health_word(resp: web.StreamResponse) -> str:
    """/healthz's own one-word status ("ok", or "degraded" while a model has
    failed), the only part of its body an anonymous caller may see."""
    body = resp.body if isinstance(resp, web.Response) else None
    if isinstance(body, bytes):
        word = msgspec.json.decode(body, type=_HealthWord).status
        if word in ("ok", "degraded"):
            return word
    return "ok"


class _HealthWord(msgspec.Struct):
    status: str = "ok"


async def keys_ctx(app: web.Application) -> AsyncIterator[None]:
    """Database keys become visible once the database is open."""
    gate = app[AUTH]
    gate.store = KeyStore(app[DB])
    if not gate.admin_token and (gate.config_keys or await gate.store.any_active()):
        # A keys-only deployment: every key is an admin (another key's jobs are
        # its to read and delete). Said once, where an operator looks.
        log.warning("API keys are set but no admin token: every key has admin rights (each sees, "
                    "cancels and deletes every job); set admin_token to give keys their own scope")
    yield
    app[AUTH].store = None

