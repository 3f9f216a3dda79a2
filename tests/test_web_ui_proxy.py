"""The lab UI in headless Chromium behind nginx under the example's path
prefix (``location /gpuvisor/``, which strips it): every page, asset and API
call must stay under the prefix, so the UI works wherever it is mounted."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.browser import DESKTOP, PageWatch
from tests.server import Server

# The nginx and backend fixtures (nginx from systemd/nginx.conf.example).
pytest_plugins = ["tests.proxy_support"]

pytestmark = pytest.mark.timeout(60)

PREFIX = "/gpuvisor/"


@pytest.fixture(scope="module")
def forwarded() -> dict[str, str]:
    # The browser speaks plain http to this nginx, as the example's $scheme
    # says; the default stand-in for TLS (https) would fail its POSTs'
    # same-origin check. Everything else is the example as shipped.
    return {}


def test_ui_under_a_path_prefix(browser: Any, nginx: str, backend: Server) -> None:
    base = nginx + PREFIX
    context = browser.new_context(viewport=DESKTOP)
    context.set_default_timeout(15_000)
    pg = context.new_page()
    watch = PageWatch(nginx)
    watch.attach(pg)
    paths: list[str] = []
    pg.on("request", lambda r: paths.append(urlsplit(r.url).path))
    try:
        # Overview: styled, scripted, and showing the service's health and version.
        pg.goto(base + "#/")
        service = pg.locator("section[aria-label=Service]")
        service.locator(".badge", has_text="ok").wait_for()
        version = pg.locator('meta[name="gpuvisor-version"]').get_attribute("content")
        assert version and version in service.inner_text()
        assert pg.locator("#version").inner_text() == f"v{version}"
        pg.locator("section[aria-label='Loaded models'] code", has_text=backend.model).wait_for()
        # The stylesheet applied: the top bar is a flex row, not plain block flow.
        assert pg.locator("header.topbar").evaluate("e => getComputedStyle(e).display") == "flex"

        # Models, reached through the nav as a user would.
        pg.locator("nav.primary a", has_text="Models").click()
        pg.locator(f'tr[data-model="{backend.model}"] .badge', has_text="ready").wait_for()

        # Chat: the answer streams through the prefixed /v1/responses.
        pg.locator("nav.primary a", has_text="Chat").click()
        pg.locator("#chat-model option", has_text=backend.model).wait_for(state="attached")
        pg.locator("#chat-max-tokens").fill("16")
        pg.locator("#chat-input").fill("Tell me a story")
        with pg.expect_response(lambda r: r.url == base + "v1/responses") as sent:
            pg.locator("#chat-input").press("Enter")
        assert sent.value.status == 200, sent.value.text()
        answer = pg.locator(".msg.assistant").last
        answer.locator(".usage", has_text="out").wait_for()
        assert answer.locator(".answer-text").inner_text().strip(), "streamed text is shown"
        assert pg.url.startswith(base)
    finally:
        context.close()

    outside = sorted({p for p in paths if not p.startswith(PREFIX)})
    assert not outside, f"requests outside {PREFIX}: {outside}"
    assert PREFIX + "static/app.js" in paths and PREFIX + "healthz" in paths
    watch.check()
