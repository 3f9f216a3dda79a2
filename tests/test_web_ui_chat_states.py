"""The chat and API pages in headless Chromium at 1280x800 and 390x844
against a real gpuvisor with the tiny model: a message to a model that is not
loaded says "Loading the model" (with the load's progress) until the first
token, the model picker is in view on a phone without opening the settings,
no raw response id is shown, and the API page says what the server's auth
mode really asks of a client (off, and on with an admin token).

Screenshots (light and dark) go to the test's temp dir, and to
GPUVISOR_SCREENS_DIR when set."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.browser import screens_fixture as screens  # noqa: F401 (a fixture)
from tests.browser import DESKTOP, NARROW, new_page, shoot
from tests.server import Server, poll_until, running, short_tempdir

pytestmark = pytest.mark.timeout(120)

VIEWPORTS = [pytest.param(DESKTOP, id="desktop"), pytest.param(NARROW, id="narrow")]
ADMIN = "ui-chat-admin-token"


@pytest.fixture(params=VIEWPORTS)
def page(request: pytest.FixtureRequest, browser: Any, server: Server) -> Iterator[tuple[Any, Any, str]]:
    viewport: dict[str, int] = request.param
    context, pg, watch = new_page(browser, server.base_url, viewport)
    yield pg, watch, "narrow" if viewport is NARROW else "desktop"
    context.close()


def open_chat(pg: Any, srv: Server) -> None:
    pg.goto(f"{srv.base_url}/#/chat?model={srv.model}")
    pg.wait_for_selector("main h1")
    pg.wait_for_function("m => document.querySelector('#chat-model')?.value === m", arg=srv.model)


def unload(srv: Server) -> None:
    r = httpx.post(f"{srv.base_url}/api/models/{srv.model}/unload", json={}, timeout=60)
    assert r.status_code in (200, 404), r.text
    poll_until(lambda: httpx.get(f"{srv.base_url}/api/models/{srv.model}", timeout=10).json()["state"],
               lambda state: state == "unloaded")


def max_tokens(pg: Any, n: int) -> None:
    """Short answers; on a phone the settings are folded: opened and folded again."""
    field = pg.locator("#chat-max-tokens")
    folded = not field.is_visible()
    if folded:
        pg.locator(".chat-settings summary").click()
    field.fill(str(n))
    if folded:
        pg.locator(".chat-settings summary").click()


def fits_the_width(pg: Any) -> None:
    width = pg.evaluate("() => document.documentElement.scrollWidth")
    viewport = pg.viewport_size["width"]
    assert width <= viewport, f"the page scrolls sideways at {viewport}px: {width}"


def in_view(pg: Any, selector: str) -> None:
    box = pg.locator(selector).bounding_box()
    size = pg.viewport_size
    assert box is not None, f"{selector} is not rendered"
    assert box["x"] >= 0 and box["x"] + box["width"] <= size["width"], (selector, box)
    assert box["y"] >= 0 and box["y"] + box["height"] <= size["height"], (selector, box)


# ---------------------------------------------------------------- loading state


def test_a_message_to_an_unloaded_model_says_it_loads(page: tuple[Any, Any, str], server: Server,
                                                      screens: Path) -> None:
    pg, watch, size = page
    unload(server)
    held: list[Any] = []  # the /v1/responses POST, let through once the page was checked
    starting = {"on": False}  # the model list reports a load under way, 42% done

    def responses(route: Any) -> None:
        if route.request.method == "POST":
            held.append(route)
        else:
            route.continue_()

    def models(route: Any) -> None:
        body = route.fetch().json()
        if starting["on"]:
            for m in body["data"]:
                if m["id"] == server.model:
                    m["state"], m["load"] = "starting", {"progress": 0.42}
        route.fulfill(json=body)

    pg.route(re.compile(r"/v1/responses$"), responses)
    pg.route(re.compile(r"/api/models$"), models)
    open_chat(pg, server)
    pg.locator(f"#chat-model option[value={server.model}]", has_text="loads on first use").wait_for(state="attached")
    max_tokens(pg, 8)
    pg.locator("#chat-input").fill("Hello")
    pg.locator("#chat-input").press("Enter")
    status = pg.locator(".msg.assistant .turn-loading")
    status.get_by_text(f"Loading the model {server.model}").wait_for()
    assert status.get_attribute("role") == "status"

    # The library reports the load's progress: the turn shows it.
    starting["on"] = True
    status.locator(".pct", has_text="42%").wait_for()
    assert len(held) == 1, "the message went out once, and waits"
    assert status.locator("progress").get_attribute("aria-label") == f"loading {server.model}"
    shoot(pg, screens, f"chat-loading-{size}")

    # The request goes through: the model really loads, answers, and the line goes.
    starting["on"] = False
    pg.unroute(re.compile(r"/api/models$"))
    held[0].continue_()
    answer = pg.locator(".msg.assistant").last
    answer.locator(".usage", has_text="out").wait_for(timeout=60_000)
    assert status.is_hidden()
    assert "Loading" not in answer.inner_text()
    watch.check()


def test_a_loaded_model_shows_no_loading_line(page: tuple[Any, Any, str], server: Server) -> None:
    pg, watch, _ = page
    httpx.post(f"{server.base_url}/api/models/{server.model}/load", json={}, timeout=60).raise_for_status()
    open_chat(pg, server)
    pg.locator(f"#chat-model option[value={server.model}]", has_text="loaded").wait_for(state="attached")
    max_tokens(pg, 4)
    pg.locator("#chat-input").fill("Hi")
    with pg.expect_request(lambda r: r.url.endswith("/v1/responses") and r.method == "POST"):
        pg.locator("#chat-input").press("Enter")
    assert pg.locator(".msg.assistant .turn-loading").is_hidden()
    pg.locator(".msg.assistant .usage", has_text="out").wait_for(timeout=60_000)
    assert pg.locator(".msg.assistant .turn-loading").is_hidden()
    watch.check()


# ---------------------------------------------------------------- picker and ids


def test_model_picker_in_view_and_no_raw_response_id(page: tuple[Any, Any, str], server: Server,
                                                     screens: Path) -> None:
    pg, watch, size = page
    open_chat(pg, server)
    settings = pg.locator(".chat-settings")
    if size == "narrow":
        # Folded on a phone, yet the model can be seen and changed.
        assert settings.get_attribute("open") is None
    assert pg.locator("#chat-model").is_visible()
    in_view(pg, "#chat-model")
    shoot(pg, screens, f"chat-picker-{size}")

    pg.locator("#chat-model").select_option(server.model)
    max_tokens(pg, 6)
    pg.locator("#chat-input").fill("Hello")
    with pg.expect_response(lambda r: r.url.endswith("/v1/responses")) as first:
        pg.locator("#chat-input").press("Enter")
    assert first.value.status == 200
    pg.locator(".msg.assistant .usage", has_text="out").wait_for(timeout=60_000)
    if size == "narrow":
        settings.locator("summary").click()
    note = pg.locator(".mode-note .response-id")
    note.wait_for()
    resp_id = note.get_attribute("data-response-id") or ""
    assert resp_id.startswith("resp_"), resp_id
    assert resp_id in (note.get_attribute("title") or "")
    # Nowhere on the page as text: only in the tooltip.
    assert "resp_" not in pg.locator("body").inner_text()
    assert "continues this conversation" in note.inner_text()
    shoot(pg, screens, f"chat-continuing-{size}")
    fits_the_width(pg)

    # The next message continues from that response.
    pg.locator("#chat-input").fill("Again")
    with pg.expect_request(lambda r: r.url.endswith("/v1/responses") and r.method == "POST") as req:
        pg.locator("#chat-input").press("Enter")
    assert json.loads(req.value.post_data)["previous_response_id"] == resp_id
    pg.locator(".msg.assistant").nth(1).locator(".usage", has_text="out").wait_for(timeout=60_000)
    assert "resp_" not in pg.locator("body").inner_text()
    watch.check()


# ---------------------------------------------------------------- API page


def test_api_page_with_auth_off(page: tuple[Any, Any, str], server: Server, screens: Path) -> None:
    pg, watch, size = page
    pg.goto(f"{server.base_url}/#/api")
    note = pg.locator(".key-note[data-auth=off]")
    note.wait_for()
    text = note.inner_text()
    assert "Authentication is off" in text and "any key or none" in text, text
    assert "gpuvisor keys add NAME" in text and "turns authentication on" in text, text
    python = pg.locator("[data-snippet=python] pre").inner_text()
    assert "auth is off here" in python, python
    note.scroll_into_view_if_needed()
    shoot(pg, screens, f"api-auth-off-{size}")
    fits_the_width(pg)
    watch.check()


@pytest.fixture(scope="module")
def auth_server(tiny_model_path: Path) -> Iterator[Server]:
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    with running(Server(models, env={"GPUVISOR_ADMIN_TOKEN": ADMIN})) as srv:
        yield srv


@pytest.mark.parametrize("viewport", VIEWPORTS)
def test_api_page_with_auth_on(browser: Any, auth_server: Server, viewport: dict[str, int], screens: Path) -> None:
    size = "narrow" if viewport is NARROW else "desktop"
    # /v1 without a key is refused: what the page must say.
    assert httpx.get(f"{auth_server.base_url}/v1/models", timeout=10).status_code == 401
    context, pg, watch = new_page(browser, auth_server.base_url, viewport)
    try:
        context.set_extra_http_headers({"Authorization": f"Bearer {ADMIN}"})
        pg.goto(f"{auth_server.base_url}/#/api")
        note = pg.locator(".key-note[data-auth=on]")
        note.wait_for()
        text = note.inner_text()
        assert "Authentication is on" in text and "needs an API key" in text, text
        assert "any key or none" not in text and "any value is accepted" not in text, text
        python = pg.locator("[data-snippet=python] pre").inner_text()
        assert "any text" not in python and "gpuvisor keys add" in python, python
        note.scroll_into_view_if_needed()
        shoot(pg, screens, f"api-auth-on-{size}")
        fits_the_width(pg)
        watch.check()
    finally:
        context.close()
