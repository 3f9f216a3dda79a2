"""The admin sign-in page: ``GET /login``, ``POST /login`` (sets the session
cookie) and ``POST /logout``."""

from __future__ import annotations

import asyncio
import html
from collections.abc import Mapping

from aiohttp import web

from supervisor.appkeys import ASSETS, AUTH, CONFIG
from supervisor.errors import PayloadTooLarge, RequestTimeout

SESSION_COOKIE = "gpuvisor_session"
# The login form is one token: a few KiB, not the API's body limit.
LOGIN_MAX_BYTES = 4096

# Where web/login.html says a word to the user (a wrong token).
_MESSAGE_SLOT = b"<!--MESSAGE-->"


def _page(request: web.Request, message: str = "", status: int = 200) -> web.Response:
    """web/login.html, built with the UI's assets (styled like the UI, light and
    dark), with ``message`` (our own fixed text, escaped anyway) in its slot."""
    body = request.app[ASSETS].login.body
    if message:
        body = body.replace(_MESSAGE_SLOT, f'<p class="notice error" role="alert">{html.escape(message)}</p>'.encode())
    # Never cached: the page is tiny and a stale copy would point at old assets.
    return web.Response(body=body, status=status, content_type="text/html", charset="utf-8",
                        headers={"Cache-Control": "no-store"})


async def login_page(request: web.Request) -> web.Response:
    return _page(request)


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
        return _page(request, "Wrong token.", status=401)
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


def add_routes(app: web.Application) -> None:
    app.router.add_get("/login", login_page)
    app.router.add_post("/login", login)
    app.router.add_post("/logout", logout)

