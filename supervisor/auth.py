"""Authentication and browser safety.

- API keys (``Authorization: Bearer gv_<id>_<secret>``) for ``/v1/*``: each has
  a name; only a salted scrypt hash is stored, in the database (added and
  revoked with ``gpuvisor keys``) or in config (``api_keys``). The public id
  selects the one hash to check, so a request costs one scrypt at most, and a
  verified key is remembered (as a digest) for later requests.
- An admin token for ``/api/*`` mutations and the UI (bearer, or a session
  cookie set by ``POST /login``). Without an admin token, API keys are admins.
- ``/healthz``, ``/readyz`` and ``/login`` stay open. With nothing configured
  everything is open (the CLI refuses a non-loopback bind in that case).
- State-changing requests from a browser must come from our own origin (CSRF);
  every response carries security headers.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from aiohttp import web
from aiohttp.typedefs import Middleware

from supervisor.config import Config
from supervisor.db import Database
from supervisor.errors import ApiError, BadRequest, Conflict, NotFound, Unauthorized
from supervisor.keys import DB

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Role = Literal["user", "admin"]

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
SESSION_COOKIE = "gpuvisor_session"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/login"})
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


# ---------------------------------------------------------------- hashing


def hash_secret(secret: str, salt: bytes | None = None) -> str:
    salt = salt or secrets.token_bytes(16)
    digest = hashlib.scrypt(secret.encode(), salt=salt, n=_SCRYPT_N, r=_SCRYPT_R, p=_SCRYPT_P, dklen=32)
    return f"scrypt${_SCRYPT_N}${_SCRYPT_R}${_SCRYPT_P}${salt.hex()}${digest.hex()}"


def verify_secret(secret: str, stored: str) -> bool:
    parts = stored.split("$")
    if len(parts) != 6 or parts[0] != "scrypt" or not all(p.isdigit() for p in parts[1:4]):
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


def key_id_of(key: str) -> str | None:
    if not key.startswith(KEY_PREFIX):
        return None
    key_id, sep, rest = key[len(KEY_PREFIX):].partition("_")
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


# ---------------------------------------------------------------- the gate


@dataclass(frozen=True)
class Principal:
    name: str
    role: Role


class Auth:
    """Who is calling, and may they? Owns the verified-key cache and sessions."""

    def __init__(self, store: KeyStore | None, config_keys: dict[str, KeyRecord], admin_token: str,
                 allowed_origins: Sequence[str] = (), clock: Callable[[], float] = time.monotonic,
                 enabled_ttl: float = 1.0, session_ttl: float = 12 * 3600) -> None:
        self.store = store
        self.config_keys = config_keys
        self.admin_token = admin_token
        self.allowed_origins = frozenset(o.rstrip("/") for o in allowed_origins)
        self.clock = clock
        self.enabled_ttl = enabled_ttl
        self.session_ttl = session_ttl
        self._verified: dict[str, bytes] = {}  # key id (or "admin") -> sha256 of the presented secret
        self._sessions: dict[str, float] = {}  # session id -> expiry
        self._enabled_at = -enabled_ttl
        self._db_keys = False

    @classmethod
    def from_config(cls, cfg: Config) -> Auth:
        return cls(None, parse_config_keys(cfg.api_keys), cfg.admin_token, cfg.allowed_origins)

    async def enabled(self) -> bool:
        if self.admin_token or self.config_keys:
            return True
        if self.store is None:
            return False
        now = self.clock()
        if now - self._enabled_at >= self.enabled_ttl:
            # Cached briefly: keys added by the CLI take effect within the TTL.
            self._db_keys = await self.store.any_active()
            self._enabled_at = now
        return self._db_keys

    async def _check_cached(self, slot: str, secret: str, stored: str) -> bool:
        digest = _digest(secret)
        known = self._verified.get(slot)
        if known is not None and hmac.compare_digest(known, digest):
            return True
        if not await asyncio.to_thread(verify_secret, secret, stored):
            return False
        self._verified[slot] = digest
        return True

    async def check_admin_token(self, token: str) -> bool:
        if not self.admin_token:
            return False
        if self.admin_token.startswith("scrypt$"):
            return await self._check_cached("admin", token, self.admin_token)
        # Digests of equal length: no timing leak of the token or its length.
        return hmac.compare_digest(_digest(token), _digest(self.admin_token))

    async def identify_bearer(self, token: str) -> Principal | None:
        # API keys first: their id picks the one hash to check, so a key
        # request never pays for a scrypt of a hashed admin token.
        key_id = key_id_of(token)
        record = None if key_id is None else self.config_keys.get(key_id)
        if key_id is not None and record is None and self.store is not None:
            record = await self.store.lookup(key_id)
        if key_id is not None and record is not None:
            if not await self._check_cached(key_id, token, record.hash):
                return None
            return Principal(record.name, "user" if self.admin_token else "admin")
        if await self.check_admin_token(token):
            return Principal("admin", "admin")
        return None

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
            return await self.identify_bearer(token.strip())
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
        if path.startswith("/api/"):
            return "user" if request.method in SAFE_METHODS else "admin"
        return "admin"  # the UI

    def middleware(self) -> Middleware:
        @web.middleware
        async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
            self.check_origin(request)
            need = self.required_role(request)
            if need is None or not await self.enabled():
                return await handler(request)
            who = await self.identify(request)
            if who is None:
                if request.path == "/" and "text/html" in request.headers.get("Accept", ""):
                    return web.Response(status=303, headers={"Location": "login"})
                raise Unauthorized("missing or invalid API key: send 'Authorization: Bearer <key>'",
                                   headers={"WWW-Authenticate": 'Bearer realm="gpuvisor"'})
            if need == "admin" and who.role != "admin":
                raise Forbidden(f"key {who.name!r} may not do this: it needs the admin token")
            request["auth_name"] = who.name
            return await handler(request)

        return middleware


# ---------------------------------------------------------------- login page

AUTH: web.AppKey[Auth] = web.AppKey("auth", Auth)

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


async def login(request: web.Request) -> web.StreamResponse:
    auth = request.app[AUTH]
    form = await request.post()
    token = form.get("token")
    if not isinstance(token, str) or not await auth.check_admin_token(token):
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
