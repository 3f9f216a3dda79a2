"""The lab UI's static files (``web/``): ``/`` and ``/static/{name}``.

Caching: ``index.html`` is always revalidated (``no-cache`` + ETag). Every
other file is referenced with its content hash (``static/app.js?v=<hash>``)
and, when the hash in the URL matches, cached for a year as immutable. The
hashes cover the module graph: relative imports inside the JS modules
(``from "./api.js"``) are rewritten to carry the imported file's hash, so a
new release never mixes old and new modules in one browser.

Safety: only regular files found in ``web/static/`` at startup (no dotfiles,
no symlinks, a plain name and a known type) can be served; a request names
one by its key in that table, so no request path can reach outside ``web/``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from aiohttp import web

import web as web_pkg
from supervisor.api import schema as routes_schema
from supervisor.api.browser import REFERRER_POLICY
from supervisor.appkeys import ASSETS
from supervisor.errors import NotFound

WEB_ROOT = Path(web_pkg.__file__).resolve().parent

CONTENT_TYPES = {
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".woff2": "font/woff2",
    ".json": "application/json",
}
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
IMMUTABLE = "public, max-age=31536000, immutable"

CSP = "; ".join([
    "default-src 'self'",
    "script-src 'self'",
    "style-src 'self'",
    "img-src 'self' data:",
    "connect-src 'self'",
    "font-src 'self'",
    "object-src 'none'",
    "base-uri 'none'",
    "form-action 'self'",
    "frame-ancestors 'none'",
])
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": REFERRER_POLICY,
    "X-Frame-Options": "DENY",
    "Cross-Origin-Opener-Policy": "same-origin",
}

# Relative module specifiers: `from "./x.js"`, `import "./x.js"`, `import("./x.js")`.
_JS_IMPORT = re.compile(r"""(\bfrom\s*|\bimport\s*\(?\s*)(["'])\./([A-Za-z0-9][\w.-]*\.js)\2""")
_CSS_URL = re.compile(r"""url\((["']?)\./([A-Za-z0-9][\w.-]*)\1\)""")
# Relative (``static/x``) so the UI also works under a proxy's path prefix.
_HTML_REF = re.compile(r"""((?:src|href)=")static/([A-Za-z0-9][\w.-]*)(")""")
_VERSION_TOKEN = b"__GPUVISOR_VERSION__"


@dataclass(frozen=True)
class Asset:
    body: bytes
    digest: str
    content_type: str

    @property
    def etag(self) -> str:
        return self.digest


def _digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()[:16]


def _service_version() -> str:
    try:
        return metadata.version("gpuvisor")
    except metadata.PackageNotFoundError:
        return "dev"


class AssetTable:
    """The servable files, read once, with references rewritten to hashes."""

    def __init__(self, root: Path, version: str) -> None:
        self.root = root
        self._raw = self._scan(root / "static")
        self.assets: dict[str, Asset] = {}
        for name in sorted(self._raw):
            self._build(name, set())
        self.index = self._page(root / "index.html", version)
        # The sign-in page shares the UI's stylesheet, so it is built the same way.
        self.login = self._page(root / "login.html", version)

    def _page(self, path: Path, version: str) -> Asset:
        html = path.read_bytes().replace(_VERSION_TOKEN, version.encode())
        body = self._rewrite(html, _HTML_REF, lambda m: self._ref(m.group(2), set()), 2)
        return Asset(body, _digest(body), "text/html; charset=utf-8")

    @staticmethod
    def _scan(static: Path) -> dict[str, bytes]:
        found: dict[str, bytes] = {}
        if not static.is_dir():
            return found
        for path in static.iterdir():
            # Symlinks are skipped outright: they could point out of web/.
            if path.is_symlink() or not path.is_file() or not _SAFE_NAME.match(path.name):
                continue
            if path.suffix in CONTENT_TYPES:
                found[path.name] = path.read_bytes()
        return found

    def _ref(self, name: str, building: set[str]) -> str | None:
        """The hash to append to a reference of ``name`` (None: leave as is)."""
        if name not in self._raw or name in building:  # unknown, or an import cycle
            return None
        return self._build(name, building).digest

    def _build(self, name: str, building: set[str]) -> Asset:
        if name in self.assets:
            return self.assets[name]
        building = building | {name}
        body = self._raw[name]
        suffix = Path(name).suffix
        if suffix == ".js":
            body = self._rewrite(body, _JS_IMPORT, lambda m: self._ref(m.group(3), building), 3)
        elif suffix == ".css":
            body = self._rewrite(body, _CSS_URL, lambda m: self._ref(m.group(2), building), 2)
        asset = Asset(body, _digest(body), CONTENT_TYPES[suffix])
        self.assets[name] = asset
        return asset

    @staticmethod
    def _rewrite(
        body: bytes, pattern: re.Pattern[str], ref: Callable[[re.Match[str]], str | None], group: int
    ) -> bytes:
        """Append ``?v=<hash>`` after the matched file name in each reference."""
        text = body.decode("utf-8")

        def sub(m: re.Match[str]) -> str:
            digest = ref(m)
            if digest is None:
                return m.group(0)
            cut = m.end(group) - m.start(0)
            whole = m.group(0)
            return f"{whole[:cut]}?v={digest}{whole[cut:]}"

        return pattern.sub(sub, text).encode("utf-8")




def _not_modified(request: web.Request, asset: Asset) -> bool:
    tags = request.if_none_match or ()
    return any(t.value in (asset.etag, "*") for t in tags)


def _respond(request: web.Request, asset: Asset, cache_control: str) -> web.Response:
    headers = {**SECURITY_HEADERS, "Cache-Control": cache_control, "ETag": f'"{asset.etag}"'}
    if _not_modified(request, asset):
        return web.Response(status=304, headers=headers)
    headers["Content-Type"] = asset.content_type
    return web.Response(body=asset.body, headers=headers)


async def index(request: web.Request) -> web.Response:
    return _respond(request, request.app[ASSETS].index, "no-cache")


async def static_file(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    asset = request.app[ASSETS].assets.get(name)
    if asset is None:
        raise NotFound(f"no such file: /static/{name}")
    # Long-lived only for the exact version a page asked for.
    fresh = request.query.get("v") == asset.digest
    return _respond(request, asset, IMMUTABLE if fresh else "no-cache")


def add_routes(app: web.Application) -> None:
    app[ASSETS] = AssetTable(WEB_ROOT, _service_version())
    app.router.add_get("/", index)
    app.router.add_get("/static/{name}", static_file)
    # The UI's job forms are built from this schema; registering it here keeps
    # the UI self-contained (routes_schema.add_routes is idempotent).
    routes_schema.add_routes(app)
