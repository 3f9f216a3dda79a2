"""The chat page while a job holds the only device, in Chromium: the refusal
names the job and its progress, and "wait in line" sends the message by
itself once the job has given the device back."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.browser import DESKTOP, NARROW, new_page, shoot
from tests.server import Server, short_tempdir
from tests.test_lab_e2e import submit, wait_job

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("viewport", [DESKTOP, NARROW], ids=["desktop", "mobile"])
def test_busy_device_offers_to_wait_then_sends(browser: Any, tiny_model_path: Path, viewport: dict[str, int],
                                               start_server: Callable[..., Server], tmp_path: Path) -> None:
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    srv = start_server(models)
    job = submit(srv, "sleep", {"steps": 100, "step_seconds": 0.05})
    wait_job(srv, job["id"], lambda j: j["status"] == "running" and j["progress"] > 0.05)
    context, pg, watch = new_page(browser, srv.base_url, viewport)
    try:
        pg.goto(f"{srv.base_url}/#/chat?model=tiny")
        pg.wait_for_function("() => document.querySelector('#chat-model')?.value === 'tiny'")
        pg.fill("#chat-input", "hello there")
        pg.click("form.composer button[type=submit]")
        pg.wait_for_selector(".msg.assistant.failed .notice.busy")
        notice = pg.inner_text(".notice.busy")
        assert job["id"] in notice and "% done" in notice, notice
        assert pg.get_attribute(".notice.busy a", "href") == f"#/jobs/{job['id']}"
        pg.click("button.wait-in-line")
        pg.wait_for_selector(".notice.busy .wait-position")
        assert "Waiting in line" in pg.inner_text(".notice.busy .wait-position")
        shots = Path(os.environ.get("GPUVISOR_SCREENS_DIR") or tmp_path)
        shoot(pg, shots, f"chat-waiting-{'mobile' if viewport is NARROW else 'desktop'}", both=False)
        # The job ends; the message goes out by itself and is answered.
        pg.wait_for_selector(".msg.assistant.completed, .msg.assistant.incomplete", timeout=60_000)
        assert pg.locator(".notice.busy").count() == 0
        assert pg.locator(".turn").count() == 1
        assert pg.inner_text(".msg.user .user-text") == "hello there"
        assert httpx.get(f"{srv.base_url}/api/jobs/{job['id']}", timeout=10).json()["status"] == "succeeded"
        scroll_width = pg.evaluate("document.documentElement.scrollWidth")
        assert scroll_width <= viewport["width"], scroll_width
        # The refused first try is the one error the page may have logged.
        watch.check(allow=("503",))
    finally:
        context.close()
