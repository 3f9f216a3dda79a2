"""Static files of the lab UI (``web/``), served at ``/``."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

import web as web_pkg

WEB_ROOT = Path(web_pkg.__file__).resolve().parent


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(WEB_ROOT / "index.html", headers={"Cache-Control": "no-cache"})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/", index)
