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
import hashlib
import hmac
import math
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
from aiohttp import web
from aiohttp.typedefs import Middleware

from supervisor.api.io import json_response
from supervisor.api.proxies import client_key, is_loopback_host
from supervisor.appkeys import AUTH, CONFIG, DB
from supervisor.config import AuthMode, Config
from supervisor.db import Database
from supervisor.errors import (
    ApiError,
    BadRequest,
    Conflict,
    NotFound,
    PayloadTooLarge,
    RequestTimeout,
    Unauthorized,
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Role = Literal["user", "admin"]
# Request key: the API key id whose own stored objects the caller may use; None = all.
SCOPE = "auth_scope"


def request_scope(request: web.Request) -> str | None:
    """The key id a request is scoped to (a user key), or None (admin, or auth off)."""
    scope = request.get(SCOPE)
    return scope if isinstance(scope, str) else None

AUTH_SCHEMA = [
    (
        "CREATE TABLE api_keys ("
        " id TEXT PRIMARY KEY,"
        " name TEXT NOT NULL,"
        " hash TEXT NOT NULL,"
        " created_at REAL NOT NULL,"
        " revoked_at REAL)"
    ),
    "CREATE UNIQUE INDEX api_keys_active_name ON api_keys(name) WHERE revoked_at IS NULL",
]

KEY_PREFIX = "gv_"
ADMIN_PREFIX = "gva_"  # `gpuvisor keys admin-token`
SESSION_COOKIE = "gpuvisor_session"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/login"})
PROBE_PATHS = frozenset({"/healthz", "/readyz"})
# Ours are ~55 characters; a longer bearer is no credential of ours.
MAX_TOKEN_CHARS = 256
# The login form is one token: a few KiB, not the API's body limit.
LOGIN_MAX_BYTES = 4096
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
# /v1 and /api routes whose body is not JSON (multipart uploads).
NON_JSON_BODIES = frozenset({"/api/datasets"})
# scrypt cost: ~16 MiB and tens of ms once per key per process (then cached).
_SCRYPT_N, _SCRYPT_R, _SCRYPT_P = 1 << 14, 8, 1

SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cross-Origin-Opener-Policy": "same-origin",
    # No inline scripts or styles anywhere in the UI.
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; "
    "frame-ancestors 'none'; form-action 'self'",
}


class Forbidden(ApiError):
    status = 403
    type = "permission_error"
    code = "forbidden"


class TooManyRequests(ApiError):
    """Too many failed authentications from this client (429, Retry-After)."""

    status = 429
    type = "requests"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after)})


class UnsupportedMediaType(ApiError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class OpenlyExposed(ApiError):
    """Authentication is off on a non-loopback address (503; waiting won't fix it)."""

    status = 503
    type = "server_error"
    code = "authentication_not_configured"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"x-should-retry": "false"})


# ---------------------------------------------------------------- hashing


def hash_secret(secret: str, salt: bytes | None = None) -> str:
    """``scrypt$N$r$p$salt$digest``; for an admin token, ``$<its id>`` follows
    (public, like a key's id: it lets a wrong token be refused unhashed)."""
    salt = salt or secrets.token_bytes(16)
    digest = hashlib.scrypt(secret.encode(), salt=salt, n=_SCRYPT_N, r=_SCRYPT_R, p=_SCRYPT_P, dklen=32)
    hashed = f"scrypt${_SCRYPT_N}${_SCRYPT_R}${_SCRYPT_P}${salt.hex()}${digest.hex()}"
    admin_id = key_id_of(secret, ADMIN_PREFIX)
    return hashed if admin_id is None else f"{hashed}${admin_id}"


def hashed_id(stored: str) -> str | None:
    """The public id a hash carries (admin tokens hashed since ids were added)."""
    parts = stored.split("$")
    return parts[6] if len(parts) == 7 else None


def verify_secret(secret: str, stored: str) -> bool:
    parts = stored.split("$")
    if len(parts) not in (6, 7) or parts[0] != "scrypt" or not all(p.isdigit() for p in parts[1:4]):
        return False
    n, r, p = (int(x) for x in parts[1:4])
    try:
        salt, want = bytes.fromhex(parts[4]), bytes.fromhex(parts[5])
        got = hashlib.scrypt(secret.encode(), salt=salt, n=n, r=r, p=p, dklen=len(want))
    except ValueError:
        return False
    return hmac.compare_digest(got, want)


def new_api_key() -> tuple[str, str]:
    """(public id, full key); the key is shown once and never stored."""
    key_id = secrets.token_hex(4)
    return key_id, f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"


def key_id_of(key: str, prefix: str = KEY_PREFIX) -> str | None:
    if not key.startswith(prefix):
        return None
    key_id, sep, rest = key[len(prefix):].partition("_")
    return key_id if sep and rest and len(key_id) == 8 else None


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


@dataclass(frozen=True)
class KeyRecord:
    id: str
    name: str
    hash: str
    source: Literal["config", "database"]
    created_at: float | None = None


def parse_config_keys(entries: Sequence[str]) -> dict[str, KeyRecord]:
    """``api_keys = ["NAME:ID:HASH", ...]`` as printed by ``gpuvisor keys add --print-config``."""
    out: dict[str, KeyRecord] = {}
    for entry in entries:
        name, _, rest = entry.partition(":")
        key_id, _, hashed = rest.partition(":")
        if not name or len(key_id) != 8 or not hashed.startswith("scrypt$"):
            raise ValueError("api_keys entries must look like NAME:ID:scrypt$... "
                             "(see `gpuvisor keys add NAME --print-config`)")
        out[key_id] = KeyRecord(key_id, name, hashed, "config")
    return out


# ---------------------------------------------------------------- key store


class KeyStore:
    """API keys in the parent's database."""

    def __init__(self, db: Database, clock: Callable[[], float] = time.time) -> None:
        self.db = db
        self.clock = clock

    async def add(self, name: str) -> tuple[KeyRecord, str]:
        if not name or len(name) > 64 or not name.replace("-", "").replace("_", "").isalnum():
            raise BadRequest("a key name is 1-64 letters, digits, '-' or '_'", param="name")
        key_id, key = new_api_key()
        hashed = await asyncio.to_thread(hash_secret, key)
        now = self.clock()
        async with self.db.write() as conn:
            found = await conn.execute_fetchall(
                "SELECT 1 FROM api_keys WHERE name = ? AND revoked_at IS NULL", (name,))
            if found:
                raise Conflict(f"an active key named {name!r} exists; revoke it first", param="name")
            await conn.execute("INSERT INTO api_keys (id, name, hash, created_at) VALUES (?, ?, ?, ?)",
                               (key_id, name, hashed, now))
        return KeyRecord(key_id, name, hashed, "database", now), key

    async def revoke(self, name_or_id: str) -> KeyRecord:
        async with self.db.write() as conn:
            rows = list(await conn.execute_fetchall(
                "UPDATE api_keys SET revoked_at = ? WHERE (name = ? OR id = ?) AND revoked_at IS NULL "
                "RETURNING id, name, hash, created_at", (self.clock(), name_or_id, name_or_id)))
        if not rows:
            raise NotFound(f"no active key named {name_or_id!r}", param="name")
        r = rows[0]
        return KeyRecord(r["id"], r["name"], r["hash"], "database", r["created_at"])

    async def active(self) -> list[KeyRecord]:
        rows = await self.db.conn.execute_fetchall(
            "SELECT id, name, hash, created_at FROM api_keys WHERE revoked_at IS NULL ORDER BY created_at")
        return [KeyRecord(r["id"], r["name"], r["hash"], "database", r["created_at"]) for r in rows]

    async def lookup(self, key_id: str) -> KeyRecord | None:
        rows = list(await self.db.conn.execute_fetchall(
            "SELECT id, name, hash, created_at FROM api_keys WHERE id = ? AND revoked_at IS NULL",
            (key_id,)))
        return None if not rows else KeyRecord(
            rows[0]["id"], rows[0]["name"], rows[0]["hash"], "database", rows[0]["created_at"])

    async def any_active(self) -> bool:
        rows = list(await self.db.conn.execute_fetchall(
            "SELECT EXISTS(SELECT 1 FROM api_keys WHERE revoked_at IS NULL)"))
        return bool(rows[0][0])

    async def any_ever(self) -> bool:
        """A key was ever stored (revoking keeps the row): auth was configured."""
        rows = list(await self.db.conn.execute_fetchall("SELECT EXISTS(SELECT 1 FROM api_keys)"))
        return bool(rows[0][0])


# ---------------------------------------------------------------- failure budget


class FailureLimiter:
    """Failed authentications per client (``client_key``): a bucket of
    ``limit`` that refills evenly over ``window`` seconds."""

    def __init__(self, limit: int = 10, window: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, max_clients: int = 10_000) -> None:
        self.limit = float(limit)
        self.rate = limit / window
        self.clock = clock
        self.max_clients = max_clients
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, when)

    def _tokens(self, key: str, now: float) -> float:
        tokens, then = self._buckets.get(key, (self.limit, now))
        return min(self.limit, tokens + (now - then) * self.rate)

    def check(self, client: str) -> None:
        """Raise TooManyRequests while ``client`` has no failure left."""
        tokens = self._tokens(client_key(client), self.clock())
        if tokens < 1:
            wait = max(1, math.ceil((1 - tokens) / self.rate))
            raise TooManyRequests(f"too many failed authentications from this address; retry in {wait} s",
                                  retry_after=wait)

    def record(self, client: str) -> None:
        key, now = client_key(client), self.clock()
        self._buckets[key] = (self._tokens(key, now) - 1, now)
        if len(self._buckets) > self.max_clients:
            self._prune(now)

    def _prune(self, now: float) -> None:
        for key in [k for k in self._buckets if self._tokens(k, now) >= self.limit]:
            del self._buckets[key]
        # Still full: the oldest go (so many addresses outrun any per-address budget).
        while len(self._buckets) > self.max_clients:
            del self._buckets[next(iter(self._buckets))]


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
        return hmac.compare_digest(_digest(token), _digest(self.admin_token))

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
        digest = _digest(token)
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
        A request with an Authorization header cannot be forged by a page."""
        if request.method in SAFE_METHODS or "Authorization" in request.headers:
            return
        origin = request.headers.get("Origin")
        if origin is None:
            if request.headers.get("Sec-Fetch-Site") == "cross-site":
                raise Forbidden("cross-site request refused", code="csrf_origin")
            return
        own = f"{request.scheme}://{request.host}"
        if origin.rstrip("/") != own and origin.rstrip("/") not in self.allowed_origins:
            raise Forbidden(f"request from origin {origin!r} refused (expected {own})",
                            code="csrf_origin")

    @staticmethod
    def required_role(request: web.Request) -> Role | None:
        path = request.path
        if path in OPEN_PATHS:
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


# ---------------------------------------------------------------- login page


_LOGIN_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>gpuvisor: sign in</title></head>
<body><main><h1>gpuvisor</h1>
<form method="post" action="login">
<label>Admin token <input type="password" name="token" autocomplete="current-password" required></label>
<button type="submit">Sign in</button>
</form>%s</main></body></html>
"""


async def keys_ctx(app: web.Application) -> AsyncIterator[None]:
    """Database keys become visible once the database is open."""
    app[AUTH].store = KeyStore(app[DB])
    yield
    app[AUTH].store = None


async def login_page(request: web.Request) -> web.Response:
    return web.Response(text=_LOGIN_PAGE % "", content_type="text/html")


async def _login_form(request: web.Request) -> Mapping[str, object]:
    """The form, read under a small limit and the body timeout (as JSON bodies are)."""
    cfg = request.app[CONFIG]
    too_large = PayloadTooLarge(f"the login form is limited to {LOGIN_MAX_BYTES} bytes")
    if request.content_length is not None and request.content_length > LOGIN_MAX_BYTES:
        raise too_large
    small = request.clone(client_max_size=LOGIN_MAX_BYTES)
    try:
        async with asyncio.timeout(cfg.body_timeout):
            return await small.post()
    except web.HTTPRequestEntityTooLarge as exc:
        raise too_large from exc
    except TimeoutError as exc:
        raise RequestTimeout(f"the request body did not arrive within {cfg.body_timeout:g} s") from exc


async def login(request: web.Request) -> web.StreamResponse:
    auth = request.app[AUTH]
    token = (await _login_form(request)).get("token")
    if not await auth.check_admin_token(token if isinstance(token, str) else "", request.remote or ""):
        return web.Response(text=_LOGIN_PAGE % "<p>Wrong token.</p>", status=401, content_type="text/html")
    # Relative redirects keep working when a proxy serves us under a path.
    resp = web.Response(status=303, headers={"Location": "./"})
    resp.set_cookie(SESSION_COOKIE, auth.new_session(), httponly=True, samesite="Strict",
                    secure=request.scheme == "https", path="/", max_age=int(auth.session_ttl))
    return resp


async def logout(request: web.Request) -> web.StreamResponse:
    sid = request.cookies.get(SESSION_COOKIE)
    if sid:
        request.app[AUTH].end_session(sid)
    resp = web.Response(status=303, headers={"Location": "login"})
    resp.del_cookie(SESSION_COOKIE, path="/")
    return resp


@web.middleware
async def require_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A JSON route's body must be declared application/json: a page can POST
    text/plain or a form to any site without asking, but never JSON. A body
    declared over the limit is refused for its size first (413, unread)."""
    if (request.method not in BODY_METHODS or not request.path.startswith(("/v1/", "/api/"))
            or request.path in NON_JSON_BODIES or not request.body_exists):
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


def add_routes(app: web.Application) -> None:
    app.router.add_get("/login", login_page)
    app.router.add_post("/login", login)
    app.router.add_post("/logout", logout)


def describe(record: KeyRecord) -> dict[str, Any]:
    return {"id": record.id, "name": record.name, "source": record.source, "created_at": record.created_at}
