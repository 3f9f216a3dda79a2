"""The chat's hosted tools in headless Chromium, driven as a person would,
against a real gpuvisor whose code_interpreter is enabled (its sandbox
works here) and whose other hosted tools are off.

The settings offer Code interpreter; web search, MCP and file search are
shown off, disabled, with the setting that turns each on as the tooltip. A
person switches the code interpreter on, asks the model to call a tool
(the tiny model never would by itself) and sends a message: the answer
shows the call with the code the model wrote, the logs the sandbox
printed and how long the call took, the same code and logs the stored
response holds. A saved conversation shows the call again.

The tiny model's weights are random: about half its forced calls leave the
code string open at the token limit and never run (tests/test_hosted_code.py
measured it), so the person starts a new chat and sends again, a bounded
number of times, until a call ran.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.models.demo import write_tiny_gguf
from tests.browser import screens_fixture as screens  # noqa: F401 (a fixture)
from tests.browser import new_page, shoot
from tests.sandbox_support import find_python
from tests.server import Server, running, short_tempdir

pytestmark = pytest.mark.timeout(300)
N_CTX = 8192
TRIES = 12
SECONDS = re.compile(r"^(\d+\.\d+) s$")


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    # In a thread of its own: the sandbox probe runs an event loop, and
    # Playwright's is already running in this one.
    with ThreadPoolExecutor(1) as pool:
        python, reasons = pool.submit(find_python).result()
    if python is None:
        pytest.skip("no sandbox on this machine: " + "; ".join(reasons))
    models = short_tempdir("gvm")
    write_tiny_gguf(models / "tiny.gguf", n_ctx=N_CTX)
    env = {"GPUVISOR_N_CTX": str(N_CTX), "GPUVISOR_CODE_INTERPRETER": "true",
           "GPUVISOR_CODE_INTERPRETER_PYTHON": python, "GPUVISOR_HOSTED_MAX_ITERATIONS": "2",
           "GPUVISOR_CODE_INTERPRETER_MAX_CONTAINERS": "100"}
    with running(Server(models, env=env, model="tiny")) as srv:
        yield srv


@pytest.fixture
def page(browser: Any, server: Server) -> Iterator[tuple[Any, Any]]:
    context, pg, watch = new_page(browser, server.base_url)
    yield pg, watch
    context.close()


def open_chat(pg: Any, srv: Server) -> None:
    pg.goto(f"{srv.base_url}/#/chat?model={srv.model}")
    pg.wait_for_function("m => document.querySelector('#chat-model')?.value === m", arg=srv.model)
    pg.locator(".tool-switch[data-tool=code_interpreter]").wait_for()


def finished(pg: Any) -> None:
    """The last answer stopped streaming."""
    pg.locator(".msg.assistant").last.wait_for()
    pg.wait_for_function("() => [...document.querySelectorAll('.msg.assistant')].pop()"
                         "?.getAttribute('aria-busy') === 'false'", timeout=180_000)


def stored_call(srv: Server, response_id: str) -> dict[str, Any]:
    body = httpx.get(f"{srv.base_url}/v1/responses/{response_id}", timeout=30).json()
    return next(o for o in body["output"] if o["type"] == "code_interpreter_call" and o["status"] == "completed")


def test_tools_that_are_off_are_not_offered(page: tuple[Any, Any], server: Server) -> None:
    pg, watch = page
    open_chat(pg, server)
    assert pg.locator("#chat-tool-code_interpreter").is_enabled()
    for tool, setting in (("web_search", "web_search_searxng_url"), ("mcp", "mcp_allowed_urls"),
                          ("file_search", "file_search_embedding_model")):
        box = pg.locator(f"#chat-tool-{tool}")
        assert box.is_disabled(), tool
        assert not box.is_checked(), tool
        title = pg.locator(f"label[for=chat-tool-{tool}]").get_attribute("title") or ""
        assert f"setting {setting}" in title, (tool, title)
        row = pg.locator(f".tool-switch[data-tool={tool}]")
        assert row.get_by_text(f"off: set {setting}").is_visible(), tool
    watch.check()


def test_a_code_interpreter_call_shows_its_code_logs_and_time(page: tuple[Any, Any], server: Server,
                                                              screens: Path) -> None:
    pg, watch = page
    sent: list[dict[str, Any]] = []
    pg.on("request", lambda r: sent.append(json.loads(r.post_data))
          if r.method == "POST" and r.url.endswith("/v1/responses") else None)
    open_chat(pg, server)
    pg.locator("#chat-max-tokens").fill("1500")
    pg.locator("#chat-tool-code_interpreter").check()
    pg.locator("#chat-require-tool").check()

    ran = None
    for attempt in range(TRIES):
        if attempt:
            pg.get_by_role("button", name="New chat").click()
        pg.locator("#chat-input").fill("Compute something")
        pg.get_by_role("button", name="Send").click()
        finished(pg)
        call = pg.locator(".msg.assistant").last.locator(".hosted-call[data-kind=code_interpreter]").first
        call.wait_for()
        if call.get_attribute("data-status") == "completed":
            ran = call
            break
    assert ran is not None, f"no forced call ran in {TRIES} tries"
    assert sent[-1]["tools"] == [{"type": "code_interpreter", "container": {"type": "auto"}}]
    assert sent[-1]["tool_choice"] == "required"

    code = ran.locator(".call-code pre").inner_text()
    logs = ran.locator(".call-logs pre").inner_text()
    shown = ran.locator(".call-time").inner_text()
    assert ran.locator(".call-kind").inner_text() == "code_interpreter"
    assert ran.locator(".call-status").inner_text() == "completed"
    took = SECONDS.match(shown)
    assert took is not None, shown
    # From the call's in_progress event to its completed event: a sandbox
    # run takes a moment, never minutes (coarse bounds).
    assert 0 < float(took.group(1)) < 120, shown
    # What the page shows is what the server ran and stored.
    response_id = pg.locator(".mode-note .response-id").get_attribute("data-response-id")
    stored = stored_call(server, response_id)
    assert code == stored["code"]
    assert code
    assert logs == ("".join(o["logs"] for o in stored["outputs"] if o["type"] == "logs") or "(no output)")
    shoot(pg, screens, "chat-hosted-code", full_page=True)

    # A saved conversation shows the call again, with its time.
    pg.reload()
    pg.locator(".conversations .conv-open").first.click()
    again = pg.locator(".hosted-call[data-kind=code_interpreter][data-status=completed]").last
    again.wait_for()
    assert again.locator(".call-code pre").inner_text() == code
    assert again.locator(".call-time").inner_text() == shown
    watch.check()
