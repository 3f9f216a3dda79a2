"""Signing in as a person does, in headless Chromium, with auth on and behind
the suite's nginx under the example's path prefix: the sign-in form is filled
and clicked, then the chat answers and a dataset job is uploaded and
submitted from the UI. Forged posts from other origins are refused by the
CSRF check (``csrf_origin``), including ones that carry ``Origin: null``."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.browser import DESKTOP, NARROW, new_page
from tests.proxy_support import PROXY_ADDR
from tests.server import Server, running, short_tempdir

pytest_plugins = ["tests.proxy_support"]

pytestmark = pytest.mark.timeout(90)

PREFIX = "/gpuvisor/"
ADMIN = "signin-admin-token-0123456789"
# A loopback address of its own: another *site* than 127.0.0.1 to the browser
# (a port alone only makes another origin of the same site).
ATTACKER_HOST = "127.0.0.3"


@pytest.fixture(scope="module")
def backend(tiny_model_path: Path) -> Iterator[Server]:
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    env = {"GPUVISOR_N_CTX": "4096", "GPUVISOR_TRUSTED_PROXIES": PROXY_ADDR,
           "GPUVISOR_ADMIN_TOKEN": ADMIN, "GPUVISOR_LOG_FORMAT": "json"}
    with running(Server(models, env=env)) as srv:
        yield srv


@pytest.fixture(scope="module")
def forwarded() -> dict[str, str]:
    # Plain http between the browser and this nginx, as its $scheme says.
    return {}


def _sign_in(pg: Any, token: str) -> None:
    pg.locator("#token").fill(token)
    pg.get_by_role("button", name="Sign in").click()


def _colours(pg: Any) -> tuple[str, str]:
    """The page's and the card's background colours, as the browser computed them."""
    body, card = pg.evaluate("""() => {
        const card = document.querySelector('.signin-card');
        return [getComputedStyle(document.body).backgroundColor, getComputedStyle(card).backgroundColor];
    }""")
    return str(body), str(card)


@pytest.mark.parametrize("viewport", [DESKTOP, NARROW], ids=["desktop", "narrow"])
def test_sign_in_then_chat_and_submit_a_job(browser: Any, nginx: str, backend: Server,
                                            tmp_path: Path, viewport: dict[str, int]) -> None:
    base = nginx + PREFIX
    context, pg, watch = new_page(browser, nginx, viewport=viewport)
    try:
        # The UI sends an anonymous browser to the sign-in page, still under the prefix.
        pg.goto(base)
        pg.wait_for_url(base + "login")
        assert pg.title() == "gpuvisor: sign in"
        # Styled like the UI: a card on the page background, in light and in dark.
        light = _colours(pg)
        assert light[0] != light[1], "the sign-in card stands out from the page"
        pg.emulate_media(color_scheme="dark")
        dark = _colours(pg)
        assert dark != light, "the sign-in page follows the dark colour scheme"
        pg.emulate_media(color_scheme="light")
        width = pg.evaluate("() => document.documentElement.scrollWidth")
        assert width <= viewport["width"], f"the sign-in page scrolls sideways: {width}"

        # A wrong token says so on the page, which stays styled.
        with pg.expect_response(lambda r: r.url == base + "login" and r.request.method == "POST") as bad:
            _sign_in(pg, "not-the-token")
        assert bad.value.status == 401
        pg.get_by_role("alert").filter(has_text="Wrong token").wait_for()
        assert _colours(pg) == light

        # The right one lands on the lab UI.
        with pg.expect_response(lambda r: r.url == base + "login" and r.request.method == "POST") as good:
            _sign_in(pg, ADMIN)
        assert good.value.status == 303, good.value.text()
        pg.locator("section[aria-label=Service] .badge", has_text="ok").wait_for()
        assert pg.url.startswith(base)

        # Chat: the answer streams through the prefixed /v1/responses on the session cookie.
        pg.goto(base + "#/chat")
        pg.locator("#chat-model option", has_text=backend.model).wait_for(state="attached")
        settings = pg.locator("details.chat-settings")
        if settings.get_attribute("open") is None:  # folded on a phone: open it as a person would
            settings.locator("summary").click()
        pg.locator("#chat-max-tokens").fill("8")
        pg.locator("#chat-input").fill("Hello there")
        with pg.expect_response(lambda r: r.url == base + "v1/responses") as sent:
            pg.locator("#chat-input").press("Enter")
        assert sent.value.status == 200, sent.value.text()
        pg.locator(".msg.assistant").last.locator(".usage", has_text="out").wait_for()

        # A dataset job: the file is uploaded and the job submitted from the form.
        rows = [{"instruction": f"Say {i}", "input": "", "output": f"{i}"} for i in range(10)]
        data = tmp_path / f"signin-{viewport['width']}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        pg.goto(base + "#/jobs")
        pg.locator("#dataset-file").set_input_files(str(data))
        pg.locator(".preview").get_by_text("alpaca", exact=True).wait_for()
        with pg.expect_response(lambda r: r.url == base + "api/jobs" and r.request.method == "POST") as job:
            pg.locator("#submit-dataset button[type=submit]").click()
        assert job.value.status in (200, 201), job.value.text()
        pg.locator(".job-head .badge", has_text="succeeded").wait_for()
    finally:
        context.close()
    # The browser logs the 401 of the wrong token; that one is the point.
    watch.check(allow=("401",))


class _AttackerPage(BaseHTTPRequestHandler):
    """Pages of another site, each with a form that posts to the service."""

    target = ""

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        # /plain: an ordinary page; /noref: one that sends no referrer, so
        # the browser sends Origin: null.
        meta = '<meta name="referrer" content="no-referrer">' if self.path == "/noref" else ""
        body = (f"<!doctype html><html><head>{meta}</head><body>"
                f'<form method="post" action="{self.target}">'
                '<input name="token" value="x"><button type="submit">Go</button></form>'
                "</body></html>").encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        return  # quiet: the test reads what it needs from the browser


@pytest.fixture
def attacker(nginx: str) -> Iterator[str]:
    handler = type("Handler", (_AttackerPage,), {"target": nginx + PREFIX + "api/jobs/job_0/cancel"})
    srv = ThreadingHTTPServer((ATTACKER_HOST, 0), handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{ATTACKER_HOST}:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join()


@pytest.mark.parametrize("page", ["/plain", "/noref"])
def test_a_form_on_another_site_is_refused(browser: Any, nginx: str, attacker: str, page: str) -> None:
    context = browser.new_context(viewport=DESKTOP)
    context.set_default_timeout(15_000)
    try:
        pg = context.new_page()
        pg.goto(attacker + page)
        with pg.expect_response(lambda r: r.url.endswith("/api/jobs/job_0/cancel")) as sent:
            pg.get_by_role("button", name="Go").click()
        headers = sent.value.request.all_headers()
        expected_origin = "null" if page == "/noref" else attacker
        assert headers.get("origin") == expected_origin, headers
        assert headers.get("sec-fetch-site") == "cross-site", headers
        assert sent.value.status == 403
        assert sent.value.json()["error"]["code"] == "csrf_origin"
    finally:
        context.close()


def test_posts_that_no_browser_page_of_ours_sends_are_refused(nginx: str, backend: Server) -> None:
    """The rule as headers: what a browser on another origin, or on another
    port of the same host (``same-site``), would send is refused; the
    service's own pages (``same-origin``, also with ``Origin: null``) pass."""
    url = nginx + PREFIX + "api/jobs/job_0/cancel"
    login = httpx.post(nginx + PREFIX + "login", data={"token": ADMIN},
                       headers={"Sec-Fetch-Site": "same-origin", "Origin": "null"})
    assert login.status_code == 303, login.text
    jar = dict(login.cookies)
    refused = [
        {"Sec-Fetch-Site": "cross-site", "Origin": "null"},
        {"Sec-Fetch-Site": "same-site", "Origin": "http://127.0.0.1:1"},
        {"Sec-Fetch-Site": "cross-site"},
        {"Origin": "null"},
        {"Origin": "http://evil.example"},
    ]
    for headers in refused:
        r = httpx.post(url, cookies=jar, headers=headers)
        assert r.status_code == 403 and r.json()["error"]["code"] == "csrf_origin", (headers, r.text)
    for headers in ({"Sec-Fetch-Site": "same-origin", "Origin": "null"}, {"Origin": nginx}):
        r = httpx.post(url, cookies=jar, headers=headers)
        assert r.status_code == 404, (headers, r.text)  # past the check: no such job
