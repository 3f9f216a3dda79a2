"""The chat page with images, in Chromium: attach, preview, send, see it in the
history; refused with the reason for a model without a projector."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.browser import DESKTOP, new_page
from tests.server import Server, running, short_tempdir
from tests.tiny_vision import png, write_tiny_text_model, write_tiny_vision_pair

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    models = short_tempdir("gvv")
    write_tiny_vision_pair(models)
    (models / "text").mkdir()
    write_tiny_text_model(models / "text" / "plain.gguf", seed=1)
    with running(Server(models, model="tiny-vl")) as s:
        yield s


@pytest.fixture
def desk(browser: Any, srv: Server) -> Iterator[Any]:
    context, pg, _watch = new_page(browser, srv.base_url, DESKTOP)
    yield pg
    context.close()


def _open_chat(pg: Any, srv: Server, model: str) -> None:
    pg.goto(f"{srv.base_url}/#/chat?model={model}")
    # A function, not a bare expression: Playwright polls an expression with
    # eval(), which the page's CSP refuses once the first check fails.
    pg.wait_for_function("m => document.querySelector('#chat-model')?.value === m", arg=model)


def test_attach_preview_send_and_history(desk: Any, srv: Server, tmp_path: Path) -> None:
    image = tmp_path / "red.png"
    image.write_bytes(png(32, 32, (255, 0, 0)))
    _open_chat(desk, srv, "tiny-vl")
    desk.set_input_files("#chat-image-file", str(image))
    desk.wait_for_selector(".chat-images.attached img.chat-image")
    desk.fill("#chat-input", "what is this?")
    desk.click("form.composer button[type=submit]")
    desk.wait_for_selector(".msg.assistant.completed, .msg.assistant.incomplete", timeout=60_000)
    assert desk.locator(".msg.user img.chat-image").count() == 1
    assert desk.locator(".chat-images.attached img").count() == 0
    assert not desk.locator(".msg.assistant .form-error, .msg.assistant.failed").count()


def test_model_without_vision_refuses_with_the_reason(desk: Any, srv: Server, tmp_path: Path) -> None:
    image = tmp_path / "red.png"
    image.write_bytes(png(32, 32, (255, 0, 0)))
    _open_chat(desk, srv, "text/plain")
    desk.set_input_files("#chat-image-file", str(image))
    desk.wait_for_function("() => (document.querySelector('.composer .form-error')?.textContent ?? '').includes('takes no images')")
    assert "no vision projector" in desk.inner_text(".composer .form-error")
    assert desk.locator(".chat-images.attached img").count() == 0
