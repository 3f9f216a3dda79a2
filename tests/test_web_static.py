"""Static routes of the lab UI over plain HTTP: types, caching, 404s and
no path traversal out of ``web/``; and the job params schema route."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from aiohttp import web

from jobs.kinds import job_kinds
from supervisor.api import web as routes_web
from supervisor.api.web import AssetTable
from supervisor.app import error_middleware

pytestmark = pytest.mark.timeout(30)


class Reply(msgspec.Struct):
    status: int
    headers: dict[str, str]
    body: bytes


@pytest.fixture
async def base() -> AsyncIterator[tuple[str, int]]:
    app = web.Application(middlewares=[error_middleware])
    routes_web.add_routes(app)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = int(runner.addresses[0][1])
    yield "127.0.0.1", port
    await runner.cleanup()


async def raw_get(addr: tuple[str, int], target: str, method: str = "GET", headers: dict[str, str] | None = None) -> Reply:
    """Send the request target byte for byte: no client normalizes the path."""
    reader, writer = await asyncio.open_connection(*addr)
    lines = [f"{method} {target} HTTP/1.1", f"Host: {addr[0]}", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
    await writer.drain()
    data = await reader.read()
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    hdrs = {}
    for line in header_lines:
        k, _, v = line.partition(":")
        hdrs[k.strip().lower()] = v.strip()
    if hdrs.get("transfer-encoding") == "chunked":
        body = _unchunk(body)
    return Reply(int(status_line.split()[1]), hdrs, body)


def _unchunk(body: bytes) -> bytes:
    out = b""
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += rest[:size]
        body = rest[size + 2:]
    return out


def asset_url(index_html: str, name: str) -> str:
    found = re.search(rf'"static/{re.escape(name)}\?v=([0-9a-f]+)"', index_html)
    assert found, f"{name} is not referenced with a hash"
    return "/" + found.group(0).strip('"')


async def test_index_headers_and_hashed_references(base: tuple[str, int]) -> None:
    r = await raw_get(base, "/")
    assert r.status == 200
    assert r.headers["content-type"] == "text/html; charset=utf-8"
    assert r.headers["cache-control"] == "no-cache"
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "style-src 'self'" in csp and "unsafe-inline" not in csp
    assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["referrer-policy"] == "same-origin"
    html = r.body.decode()
    # No inline script or style, no external references.
    assert not re.search(r"<script(?![^>]*\bsrc=)", html)
    assert "<style" not in html and "style=" not in html
    assert "http://" not in html and "https://" not in html
    assert "__GPUVISOR_VERSION__" not in html
    for name in ("app.js", "style.css"):
        asset_url(html, name)
    again = await raw_get(base, "/", headers={"If-None-Match": r.headers["etag"]})
    assert again.status == 304 and again.body == b""


async def test_assets_cached_by_content_hash(base: tuple[str, int]) -> None:
    html = (await raw_get(base, "/")).body.decode()
    url = asset_url(html, "app.js")
    r = await raw_get(base, url)
    assert r.status == 200
    assert r.headers["content-type"] == "text/javascript; charset=utf-8"
    assert r.headers["cache-control"] == "public, max-age=31536000, immutable"
    assert r.headers["etag"] == f'"{url.rsplit("=", 1)[1]}"'
    assert r.headers["x-content-type-options"] == "nosniff"
    # Module imports carry their hashes too, so the whole graph is versioned.
    imports = re.findall(r"""from\s*["']\./([\w.-]+\.js)(\?v=[0-9a-f]+)?["']""", r.body.decode())
    assert imports and all(v for _, v in imports), imports
    stale = await raw_get(base, "/static/app.js?v=0000")
    assert stale.status == 200 and stale.headers["cache-control"] == "no-cache"
    plain = await raw_get(base, "/static/app.js")
    assert plain.headers["cache-control"] == "no-cache"
    revalidated = await raw_get(base, "/static/app.js", headers={"If-None-Match": r.headers["etag"]})
    assert revalidated.status == 304
    head = await raw_get(base, url, method="HEAD")
    assert head.status == 200 and head.body == b""


@pytest.mark.parametrize("name, ctype", [
    ("style.css", "text/css; charset=utf-8"),
    ("icon.svg", "image/svg+xml"),
    ("api.js", "text/javascript; charset=utf-8"),
])
async def test_content_types(base: tuple[str, int], name: str, ctype: str) -> None:
    r = await raw_get(base, f"/static/{name}")
    assert r.status == 200
    assert r.headers["content-type"] == ctype


@pytest.mark.parametrize("target", [
    "/nope",
    "/static/nope.js",
    "/static/",
    "/static/index.html",  # index.html lives in web/, served only at /
    "/static/__init__.py",
    "/index.html/../static/app.js/..",
    "/static/../supervisor/app.py",
    "/static/../../pyproject.toml",
    "/static/..%2f..%2fpyproject.toml",
    "/static/..%2Fsupervisor%2Fapp.py",
    "/static/%2e%2e/%2e%2e/pyproject.toml",
    "/static/%2e%2e%2f%2e%2e%2fpyproject.toml",
    "/static/%252e%252e%252fpyproject.toml",
    "/static/..%5c..%5cpyproject.toml",
    "/static/..\\..\\pyproject.toml",
    "/static//etc/passwd",
    "/static/%2fetc%2fpasswd",
    "/static/.%2e/web/__init__.py",
    "/%2e%2e/%2e%2e/etc/passwd",
    "/web/static/app.js",
    "/static/app.js%00.txt",
])
async def test_no_traversal_or_unknown_paths(base: tuple[str, int], target: str) -> None:
    r = await raw_get(base, target)
    assert r.status in (400, 404), (target, r.status)
    assert b"import" not in r.body and b"root:" not in r.body and b"[project]" not in r.body
    if r.status == 404:
        body = msgspec.json.decode(r.body)
        assert set(body["error"]) >= {"message", "type", "param", "code"}


def test_asset_table_skips_symlinks_dotfiles_and_unknown_types(tmp_path: Path) -> None:
    outside = tmp_path / "secret.js"
    outside.write_text("secret")
    root = tmp_path / "web"
    static = root / "static"
    static.mkdir(parents=True)
    (root / "index.html").write_text('<script type="module" src="static/a.js"></script>')
    (root / "login.html").write_text('<link rel="stylesheet" href="static/b.js">')
    (static / "a.js").write_text('import { b } from "./b.js";\nimport "./missing.js";\n')
    (static / "b.js").write_text('import { a } from "./a.js";\nexport const b = 1;\n')  # a cycle
    (static / "link.js").symlink_to(outside)
    (static / ".hidden.js").write_text("x")
    (static / "notes.py").write_text("x")
    table = AssetTable(root, "1.2.3")
    assert sorted(table.assets) == ["a.js", "b.js"]
    a = table.assets["a.js"].body.decode()
    assert f'"./b.js?v={table.assets["b.js"].digest}"' in a
    assert '"./missing.js"' in a  # unknown files are left alone
    assert f'"static/a.js?v={table.assets["a.js"].digest}"' in table.index.body.decode()


async def test_job_schema_route(base: tuple[str, int]) -> None:
    r = await raw_get(base, "/api/jobs/schema")
    assert r.status == 200
    body = msgspec.json.decode(r.body)
    kinds = {k["kind"]: k for k in body["data"]}
    assert set(kinds) == set(job_kinds())
    dataset = kinds["dataset"]["schema"]
    assert dataset["required"] == ["input"]
    assert dataset["properties"]["eval_ratio"] == {
        "type": "number", "minimum": 0.0, "exclusiveMaximum": 1.0, "default": 0.1}
    assert "Q4_K_M" in kinds["quantize"]["schema"]["properties"]["type"]["enum"]


def test_schema_routes_register_once() -> None:
    from supervisor.api import schema as routes_schema

    app = web.Application()
    routes_web.add_routes(app)
    routes_schema.add_routes(app)  # the app factory may register it too
    paths = [r.canonical for r in app.router.resources()]
    assert paths.count("/api/jobs/schema") == 1
