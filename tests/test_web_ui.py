"""The lab UI in headless Chromium against a real gpuvisor with the tiny
model: pages render, a dataset upload job succeeds, chat streams, a running
job is cancelled from its page, bad values show next to their fields.
A job page rides out a parent crash or restart without a reload.
Screenshots of each page land in the test's temp dir."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.browser import (
    DESKTOP,
    NARROW,
    PageWatch,
    new_page,
    save_screens,
)
from tests.gate_proxy import gate_proxy
from tests.server import Server

pytestmark = pytest.mark.timeout(90)

# Where a person can look at two of the screenshots after a run.
SCREENS_COPY = Path(os.environ.get("GPUVISOR_SCREENS_DIR", "/tmp/gpuvisor-screens"))


@pytest.fixture(scope="module")
def screens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("screens")


@pytest.fixture
def page(browser: Any, server: Server) -> Iterator[tuple[Any, PageWatch]]:
    context = browser.new_context(viewport=DESKTOP)
    context.set_default_timeout(20_000)
    pg = context.new_page()
    watch = PageWatch(server.base_url)
    watch.attach(pg)
    yield pg, watch
    context.close()


def open_page(pg: Any, server: Server, route: str) -> None:
    pg.goto(f"{server.base_url}/#{route}")
    pg.wait_for_selector("main h1")


def submit_sleep(server: Server, **params: Any) -> dict[str, Any]:
    r = httpx.post(f"{server.base_url}/api/jobs", json={"kind": "sleep", "params": params}, timeout=10)
    assert r.status_code in (200, 201), r.text
    job: dict[str, Any] = r.json()
    return job


def test_pages_render_with_screenshots(page: tuple[Any, PageWatch], server: Server, screens: Path) -> None:
    pg, watch = page
    open_page(pg, server, "/")
    pg.locator(".card", has_text="Loaded models").locator("code", has_text=server.model).wait_for()
    pg.locator(".card", has_text="GPU lease").locator(".badge").first.wait_for()
    pg.screenshot(path=str(screens / "overview.png"))

    open_page(pg, server, "/models")
    row = pg.locator(f'tr[data-model="{server.model}"]')
    row.locator(".badge", has_text="ready").wait_for()
    assert "llama" in row.inner_text()
    pg.locator("#pull-form").wait_for()
    pg.screenshot(path=str(screens / "models.png"))

    open_page(pg, server, "/jobs")
    pg.locator("#submit-dataset").wait_for()
    pg.screenshot(path=str(screens / "jobs.png"))

    open_page(pg, server, "/chat")
    pg.locator("#chat-model option", has_text=server.model).wait_for(state="attached")
    pg.screenshot(path=str(screens / "chat.png"))

    open_page(pg, server, "/no/such/page")
    assert pg.locator("h1").inner_text() == "Page not found"

    # Keyboard: the nav is reachable with Tab and follows Enter (from a fresh load).
    pg.reload()
    pg.wait_for_selector("main h1")
    pg.keyboard.press("Tab")  # skip link
    pg.keyboard.press("Tab")  # brand
    pg.keyboard.press("Tab")  # Overview
    pg.keyboard.press("Tab")  # Models
    pg.keyboard.press("Enter")
    pg.wait_for_function("() => location.hash === '#/models'")
    assert pg.locator("nav.primary a[aria-current=page]").inner_text() == "Models"

    pg.set_viewport_size(NARROW)
    open_page(pg, server, "/jobs")
    pg.locator("#submit-dataset").wait_for()
    width = pg.evaluate("document.documentElement.scrollWidth")
    assert width <= NARROW["width"], f"page scrolls sideways at {NARROW['width']}px: {width}"
    pg.screenshot(path=str(screens / "jobs-narrow.png"), full_page=True)
    open_page(pg, server, "/")
    pg.locator(".card", has_text="Loaded models").locator("code", has_text=server.model).wait_for()
    pg.screenshot(path=str(screens / "overview-narrow.png"), full_page=True)
    watch.check()
    save_screens(screens, ["overview.png", "jobs-narrow.png"], SCREENS_COPY)


def test_dataset_upload_job_succeeds(page: tuple[Any, PageWatch], server: Server, screens: Path,
                                     tmp_path: Path) -> None:
    pg, watch = page
    rows = [{"instruction": f"Say {i}", "input": "", "output": f"{i}"} for i in range(20)]
    data = tmp_path / "ui-alpaca.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    open_page(pg, server, "/jobs")
    pg.locator("#dataset-file").set_input_files(str(data))
    preview = pg.locator(".preview")
    preview.get_by_text("alpaca", exact=True).wait_for()
    assert "Say 0" in preview.inner_text()
    assert pg.locator("#submit-dataset-input").input_value() == "ui-alpaca.jsonl"
    pg.locator("#submit-dataset-eval_ratio").fill("0.2")
    pg.locator("#submit-dataset button[type=submit]").click()
    pg.wait_for_function("() => /^#\\/jobs\\/job_[0-9a-f]+$/.test(location.hash)")
    pg.locator(".job-head .badge", has_text="succeeded").wait_for()
    # The summary first; the raw JSON is collapsed under it.
    pg.locator("section[aria-label=Result] .result-summary").wait_for()
    raw = pg.locator("section[aria-label=Result] details.raw-result")
    assert not raw.locator("pre").is_visible()
    raw.locator("summary").click()
    # text_content: a refresh may redraw the section (folded again) meanwhile.
    result = json.loads(raw.locator("pre").text_content() or "")
    assert result, "the job's result is shown"
    assert pg.locator(".pct").inner_text() == "100%"
    assert pg.locator(".stream-state").inner_text() == "finished"
    pg.screenshot(path=str(screens / "job-dataset.png"))
    job_id = pg.url.rsplit("/", 1)[1]
    job = httpx.get(f"{server.base_url}/api/jobs/{job_id}", timeout=10).json()
    assert job["status"] == "succeeded"
    assert job["params"]["eval_ratio"] == 0.2
    watch.check()


def test_bad_values_show_next_to_their_fields(page: tuple[Any, PageWatch], server: Server,
                                              screens: Path) -> None:
    pg, watch = page
    open_page(pg, server, "/jobs")
    form = pg.locator("#submit-dataset")
    form.wait_for()
    # Checked in the page against the schema's bounds.
    pg.locator("#submit-dataset-input").fill("whatever.jsonl")
    pg.locator("#submit-dataset-eval_ratio").fill("1.5")
    form.locator("button[type=submit]").click()
    err = form.locator('[data-field="eval_ratio"] .field-error')
    err.wait_for()
    assert err.inner_text() == "must be < 1"
    assert pg.locator("#submit-dataset-eval_ratio").get_attribute("aria-invalid") == "true"
    # Refused by the API: the error names params.input and lands there.
    pg.locator("#submit-dataset-eval_ratio").fill("0.1")
    pg.locator("#submit-dataset-input").fill("no-such-file.jsonl")
    form.locator("button[type=submit]").click()
    err = form.locator('[data-field="input"] .field-error')
    err.wait_for()
    assert "no such file" in err.inner_text()
    assert form.locator('[data-field="eval_ratio"] .field-error').inner_text() == ""
    pg.screenshot(path=str(screens / "jobs-form-error.png"))
    # The browser logs the 400 it got; that is the point of this test.
    watch.check(allow=("400",))


def test_cancel_running_job_from_its_page(page: tuple[Any, PageWatch], server: Server, screens: Path) -> None:
    pg, watch = page
    job = submit_sleep(server, steps=400, step_seconds=0.05, tag="ui-cancel")
    open_page(pg, server, f"/jobs/{job['id']}")
    pg.locator(".job-head .badge", has_text="running").wait_for()
    pg.locator(".stream-state", has_text="live").wait_for()
    pg.wait_for_function("() => Number(document.querySelector('.pct')?.textContent.replace('%', '')) > 0")
    pg.screenshot(path=str(screens / "job-running.png"))
    pg.get_by_role("button", name="Cancel").click()
    pg.locator(".job-head .badge", has_text="cancelled").wait_for()
    assert pg.get_by_role("button", name="Delete").is_visible()
    pg.screenshot(path=str(screens / "job-cancelled.png"))
    status = httpx.get(f"{server.base_url}/api/jobs/{job['id']}", timeout=10).json()["status"]
    assert status == "cancelled"
    watch.check()


def test_chat_streams_text_and_shows_usage(browser: Any, server: Server, screens: Path) -> None:
    # Behind a proxy that holds the stream after its first text delta: the
    # page must show that part of the answer before the rest arrives, an
    # event the test waits for, so a busy machine cannot make it race.
    with gate_proxy(server.base_url, b"response.output_text.delta") as gate:
        base = f"http://127.0.0.1:{gate.port}"
        context, pg, watch = new_page(browser, base)
        try:
            _chat_streams_in_parts(pg, base, server, screens, gate)
        finally:
            context.close()
    watch.check(allow=("404",))


def _chat_streams_in_parts(pg: Any, base: str, server: Server, screens: Path, gate: Any) -> None:
    posts: list[str] = []

    def on_request(r: Any) -> None:
        if r.method == "POST":
            posts.append(r.url.split(base, 1)[-1])

    def long_answer(route: Any) -> None:
        # The tiny model soon says EOS; run it to the token limit so the
        # answer goes on past the held part (a test-only body change).
        body = json.loads(route.request.post_data or "{}")
        body["ignore_eos"] = True
        route.continue_(post_data=json.dumps(body))

    pg.on("request", on_request)
    pg.route(re.compile(r"/v1/(responses|chat/completions)$"), long_answer)
    pg.goto(f"{base}/#/chat")
    pg.wait_for_selector("main h1")
    pg.locator("#chat-model option", has_text=server.model).wait_for(state="attached")
    pg.locator("#chat-max-tokens").fill("150")
    pg.locator("#chat-input").fill("Tell me a story")
    pg.locator("#chat-input").press("Enter")
    answer = pg.locator(".msg.assistant").last
    usage = answer.locator(".usage")
    assert gate.held.wait(30), "the answer never streamed a text delta"
    pg.wait_for_function("""() => {
        const msg = document.querySelector('.msg.assistant:last-child');
        return (msg?.querySelector('.answer-text')?.textContent.length || 0) > 0;
    }""")
    partial = answer.locator(".answer-text").evaluate("el => el.textContent.length")
    assert not re.search(r"\bout\b", usage.inner_text() if usage.count() else ""), "usage before the end"
    gate.release()
    pg.wait_for_function("() => /out/.test(document.querySelector('.msg.assistant:last-child .usage')?.textContent || '')")
    assert re.search(r"\d+ in · \d+ out", usage.inner_text()), usage.inner_text()
    final = answer.locator(".answer-text").evaluate("el => el.textContent.length")
    assert 0 < partial < final, f"part of the answer showed before the end: {partial} of {final}"
    pg.screenshot(path=str(screens / "chat-answer.png"))
    # /v1/responses when the server has it, else the chat-completions fallback (and the page says so).
    assert posts[0] == "/v1/responses"
    if "/v1/chat/completions" in posts:
        assert "no /v1/responses" in pg.locator(".chat-settings").inner_text()
    else:
        # A second turn continues the first through previous_response_id.
        pg.unroute(re.compile(r"/v1/(responses|chat/completions)$"))
        pg.locator("#chat-input").fill("And then?")
        with pg.expect_request(lambda r: r.url.endswith("/v1/responses") and r.method == "POST") as req:
            pg.locator("#chat-input").press("Enter")
        assert json.loads(req.value.post_data)["previous_response_id"].startswith("resp")
        pg.locator(".msg.assistant").nth(1).locator(".usage", has_text="out").wait_for()


def test_stop_button_cancels_generation(browser: Any, start_server: Any, tiny_model_path: Path) -> None:
    from supervisor.models.demo import write_tiny_gguf
    from tests.server import short_tempdir

    # A long context so the generation surely outlasts the click on Stop.
    models = short_tempdir("gvm")
    write_tiny_gguf(models / "tiny.gguf", n_ctx=65536)
    server = start_server(models, env={"GPUVISOR_N_CTX": "65536"})
    context = browser.new_context(viewport=DESKTOP)
    context.set_default_timeout(20_000)
    pg = context.new_page()
    watch = PageWatch(server.base_url)
    watch.attach(pg)
    probe = httpx.post(f"{server.base_url}/v1/responses", json={}, timeout=10)
    if probe.status_code == 404:
        pytest.skip("needs /v1/responses (with ignore_eos) to make a generation long enough to stop")

    def long_answer(route: Any) -> None:
        # The tiny model soon says EOS; ask the server to run to the token
        # limit so there is a generation to stop (a test-only body change).
        body = json.loads(route.request.post_data or "{}")
        body["ignore_eos"] = True
        route.continue_(post_data=json.dumps(body))

    pg.route(re.compile(r"/v1/(responses|chat/completions)$"), long_answer)
    open_page(pg, server, "/chat")
    pg.locator("#chat-model option", has_text=server.model).wait_for(state="attached")
    pg.locator("#chat-max-tokens").fill("100000")
    pg.locator("#chat-input").fill("Go on forever")
    pg.locator("#chat-input").press("Enter")
    stop = pg.get_by_role("button", name="Stop")
    stop.wait_for()
    pg.wait_for_function("() => (document.querySelector('.msg.assistant:last-child .answer-text')?.textContent || '').length > 0")
    stop.click()
    pg.locator(".msg.assistant.stopped").wait_for()
    assert "stopped" in pg.locator(".msg.assistant.stopped .usage").inner_text()
    assert not stop.is_visible()
    # The worker goes idle again: the generation was cancelled, not left running.
    pg.wait_for_function(
        """async () => (await (await fetch('/api/workers')).json()).workers.every(w => w.in_flight === 0)""",
        polling=200)
    watch.check(allow=("404",))
    context.close()


def test_asks_for_the_admin_token_once_on_401(browser: Any, start_server: Any, tiny_model_path: Path) -> None:
    from supervisor.config import Config
    from tests.server import short_tempdir

    if "admin_token" not in Config.__struct_fields__:
        pytest.skip("this build of gpuvisor has no admin token")
    token = "ui-test-admin-token"
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    srv = start_server(models, env={"GPUVISOR_ADMIN_TOKEN": token})
    if httpx.get(f"{srv.base_url}/api/jobs", timeout=10).status_code != 401:
        pytest.skip("this build of gpuvisor has no admin token")
    context = browser.new_context(viewport=DESKTOP)
    context.set_default_timeout(20_000)
    try:
        # The page itself comes through the login cookie; then the cookie goes
        # away (expired session), so API calls get 401 and the UI must ask.
        assert context.request.post(f"{srv.base_url}/login", form={"token": token}, max_redirects=0).status == 303
        pg = context.new_page()
        sent: list[tuple[str, str | None]] = []

        def on_request(r: Any) -> None:
            if "/api/" in r.url:
                sent.append((r.url, r.headers.get("authorization")))

        pg.on("request", on_request)
        pg.goto(f"{srv.base_url}/#/jobs")
        pg.wait_for_selector("main h1")
        context.clear_cookies()
        dialog = pg.locator("dialog.auth-dialog")
        dialog.wait_for()
        assert pg.locator("dialog.auth-dialog").count() == 1, "one prompt for concurrent 401s"
        pg.locator("#auth-token").fill(token)
        pg.get_by_role("button", name="Use token").click()
        pg.locator("section[aria-label='Job list'] .empty").wait_for()
        pg.wait_for_function("() => !document.querySelector('dialog.auth-dialog')")
        assert pg.evaluate("() => sessionStorage.getItem('gpuvisor.adminToken')") == token
        assert any(auth == f"Bearer {token}" for _, auth in sent)
        assert all(token not in url for url, _ in sent), "the token never goes in a URL"
        assert token not in pg.url
    finally:
        context.close()


def _running_job_page(browser: Any, start_server: Any, tiny_model_path: Path,
                      on_job_get: Any = None) -> tuple[Server, Any, Any, PageWatch, str]:
    """A fresh server with a long sleep job running, and its page open and live."""
    from tests.server import short_tempdir

    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    srv = start_server(models)
    job_id = submit_sleep(srv, steps=2000, step_seconds=0.05, tag="ui-restart")["id"]
    deadline = time.monotonic() + 20
    while httpx.get(f"{srv.base_url}/api/jobs/{job_id}", timeout=10).json()["status"] != "running":
        assert time.monotonic() < deadline, "the job never started"
        time.sleep(0.05)
    context = browser.new_context(viewport=DESKTOP)
    context.set_default_timeout(20_000)
    pg = context.new_page()
    watch = PageWatch(srv.base_url)
    watch.attach(pg)
    if on_job_get is not None:
        pg.route(f"{srv.base_url}/api/jobs/{job_id}", on_job_get)
    open_page(pg, srv, f"/jobs/{job_id}")
    pg.locator(".job-head .badge", has_text="running").wait_for()
    pg.locator(".stream-state[data-state=live]").wait_for()
    pg.wait_for_function("() => Number(document.querySelector('.pct')?.textContent.replace('%', '')) > 0")
    pg.evaluate("() => { window.__marker = 1; }")  # gone if the page reloads
    return srv, context, pg, watch, job_id


def test_job_page_resumes_after_parent_crash(browser: Any, start_server: Any, tiny_model_path: Path) -> None:
    # The job refresh the page makes once its stream is live is held until
    # the parent is dead: a request in flight when it dies (seen as a race).
    held: list[Any] = []
    seen = {"job_gets": 0}

    def on_job_get(route: Any) -> None:
        seen["job_gets"] += 1
        if seen["job_gets"] == 2:
            held.append(route)
        else:
            route.continue_()

    srv, context, pg, watch, job_id = _running_job_page(browser, start_server, tiny_model_path, on_job_get)
    try:
        resumes: list[str | None] = []  # the Last-Event-ID of each events request from now on
        pg.on("request", lambda r: resumes.append(r.headers.get("last-event-id"))
              if r.url.endswith(f"/api/jobs/{job_id}/events") else None)
        badge = pg.locator(".job-head .badge").first
        banner = pg.locator("#connection-banner")
        action_error = pg.locator(".job-head + div")
        for _ in range(100):  # the refresh comes 0.3 s after the stream went live
            if held:
                break
            pg.wait_for_timeout(50)
        assert held, "the page did not refresh the job when its stream went live"

        # A crash cuts the stream (SIGTERM would end it cleanly): the page says
        # it is reconnecting and keeps what it knew; it neither freezes nor fails.
        srv.stop(signal.SIGKILL)
        held[0].continue_()
        pg.locator(".stream-state[data-state=reconnecting]").wait_for()
        assert pg.locator(".stream-state").inner_text() == "reconnecting…"
        banner.wait_for(state="visible")
        action_error.get_by_text("Could not refresh the job").wait_for()
        assert badge.inner_text() == "running"

        # Boot recovery marks the job interrupted; the same page resumes its
        # stream after the last event it had and shows that, without a reload.
        srv.start()
        badge.filter(has_text="interrupted").wait_for()
        pg.locator(".stream-state[data-state=ended]").wait_for()
        assert pg.locator(".stream-state").inner_text() == "finished"
        banner.wait_for(state="hidden")
        action_error.locator(".notice").wait_for(state="detached")
        assert pg.evaluate("() => window.__marker") == 1, "the page was reloaded"
        assert "supervisor restarted" in pg.locator("section[aria-label=Status]").inner_text()
        assert pg.get_by_role("button", name="Delete").is_visible()
        # Each try after the crash asked only for the events after the last it had.
        assert resumes and all(x is not None and int(x) > 0 for x in resumes), resumes
        assert httpx.get(f"{srv.base_url}/api/jobs/{job_id}", timeout=10).json()["status"] == "interrupted"
        # Refused while the parent was down, and the stream it cut.
        watch.check(allow=("net::ERR_CONNECTION_REFUSED", "net::ERR_INCOMPLETE_CHUNKED_ENCODING"))
    finally:
        context.close()


def test_job_page_after_parent_restart(browser: Any, start_server: Any, tiny_model_path: Path) -> None:
    srv, context, pg, watch, job_id = _running_job_page(browser, start_server, tiny_model_path)
    try:
        badge = pg.locator(".job-head .badge").first
        banner = pg.locator("#connection-banner")
        # SIGTERM: the job is stopped as interrupted and the stream ends with
        # that before the parent exits; the page's next requests are refused.
        srv.stop()
        badge.filter(has_text="interrupted").wait_for()
        pg.locator(".stream-state[data-state=ended]").wait_for()
        assert "supervisor shut down" in pg.locator("section[aria-label=Status]").inner_text()
        banner.wait_for(state="visible")

        # Back up: the banner goes although this page has nothing left to
        # fetch, and no error from while it was down stays behind.
        srv.start()
        banner.wait_for(state="hidden")
        assert pg.evaluate("() => window.__marker") == 1, "the page was reloaded"
        assert badge.inner_text() == "interrupted"
        assert pg.locator(".job-head + div").inner_text() == ""
        assert httpx.get(f"{srv.base_url}/api/jobs/{job_id}", timeout=10).json()["status"] == "interrupted"
        watch.check(allow=("net::ERR_CONNECTION_REFUSED",))
    finally:
        context.close()
