"""The chat's hosted tools in headless Chromium, driven as a person would,
against a real gpuvisor whose code_interpreter (its sandbox works here),
web_search (a local stand-in for SearXNG), mcp (a local MCP server made
with the official SDK) and file_search (the tiny model embeds a vector
store's file) are enabled, and against one where every tool is off.

On the second, each tool is shown off, disabled, with the setting that
turns it on as the tooltip. On the first, a person switches one tool on,
asks the model to call a tool (the tiny model never would by itself) and
sends a message: the answer shows the call with what the model asked (the
code, the query, the MCP tool and its arguments), what came back (the
sandbox's logs, the search's sources, the server's tools and output, the
chunks found) and how long it took, as the stored response holds them. A
saved conversation shows the call again.

The tiny model's weights are random: about half its forced calls leave a
string open at the token limit and never run (tests/test_hosted_code.py
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
from tests.browser import DESKTOP, NARROW, new_page, shoot
from tests.sandbox_support import find_python
from tests.searxng_fake import RESULTS, FakeSearxng
from tests.mcp_support import mcp_server
from tests.server import Server, poll_until, running, short_tempdir

pytestmark = pytest.mark.timeout(300)
N_CTX = 8192
TRIES = 12
HERON = " ".join(f"The heron counts {i} silver pebbles beside the quiet mill pond." for i in range(24))
TIME = re.compile(r"^(\d+) ms$|^(\d+\.\d+) s$")


@pytest.fixture(scope="module")
def search() -> Iterator[FakeSearxng]:
    fake = FakeSearxng().start()
    yield fake
    fake.stop()


@pytest.fixture(scope="module")
def mcp_url() -> Iterator[str]:
    with mcp_server() as url:
        yield url


@pytest.fixture(scope="module")
def server(search: FakeSearxng, mcp_url: str) -> Iterator[Server]:
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
           "GPUVISOR_CODE_INTERPRETER_MAX_CONTAINERS": "100", "GPUVISOR_WEB_SEARCH_SEARXNG_URL": search.url,
           "GPUVISOR_MCP_ALLOWED_URLS": mcp_url, "GPUVISOR_FILE_SEARCH_EMBEDDING_MODEL": "tiny",
           # The MCP server's hang tool, should the model pick it, ends within this.
           "GPUVISOR_HOSTED_CALL_TIMEOUT_S": "10"}
    with running(Server(models, env=env, model="tiny")) as srv:
        yield srv


@pytest.fixture(scope="module")
def bare() -> Iterator[Server]:
    """Every hosted tool off; no model (the settings need none)."""
    with running(Server(short_tempdir("gvm"))) as srv:
        yield srv


@pytest.fixture(scope="module")
def store(server: Server) -> str:
    """A vector store holding one file, indexed."""
    up = httpx.post(f"{server.base_url}/v1/files", files={"file": ("heron.md", HERON.encode())},
                    data={"purpose": "assistants"}, timeout=60)
    assert up.status_code == 200, up.text
    made = httpx.post(f"{server.base_url}/v1/vector_stores", json={"name": "heron", "file_ids": [up.json()["id"]]},
                      timeout=60)
    assert made.status_code == 200, made.text
    store_id: str = made.json()["id"]
    poll_until(lambda: httpx.get(f"{server.base_url}/v1/vector_stores/{store_id}", timeout=30).json(),
               lambda s: s["file_counts"]["completed"] == 1, timeout=120)
    return store_id


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


def stored(srv: Server, pg: Any, kind: str) -> dict[str, Any]:
    """The first call of ``kind`` that ran in the page's last stored response."""
    note = pg.locator(".mode-note .response-id")
    # The page names the stored response once the turn has ended (finished()
    # waited for that), unless the turn failed: then say how it reads.
    assert note.count() == 1, "no stored response; the last answer reads: " + pg.locator(".msg.assistant").last.inner_text()
    response_id = note.get_attribute("data-response-id")
    body = httpx.get(f"{srv.base_url}/v1/responses/{response_id}", timeout=30).json()
    return next(o for o in body["output"] if o["type"] == kind and o.get("status") != "incomplete")


def send_until(pg: Any, kind: str, ran: tuple[str, ...]) -> tuple[Any, list[dict[str, Any]]]:
    """Send with "Make the model call a tool" on, in a new chat each time,
    until the answer shows an item of type ``kind`` whose status is one of
    ``ran``: that call's view, and the request bodies sent."""
    sent: list[dict[str, Any]] = []
    pg.on("request", lambda r: sent.append(json.loads(r.post_data))
          if r.method == "POST" and r.url.endswith("/v1/responses") else None)
    pg.locator("#chat-max-tokens").fill("1500")
    pg.locator("#chat-require-tool").check()
    for attempt in range(TRIES):
        if attempt:
            pg.get_by_role("button", name="New chat").click()
        pg.locator("#chat-input").fill("Find out")
        pg.get_by_role("button", name="Send").click()
        finished(pg)
        calls = pg.locator(".msg.assistant").last.locator(f".hosted-call[data-type={kind}]")
        calls.first.wait_for()
        for i in range(calls.count()):
            status = calls.nth(i).get_attribute("data-status")
            if status in ran:
                return calls.nth(i), sent
            if status == "incomplete" and kind != "mcp_call":
                # Left unfinished by the model, never run: no time to show.
                assert calls.nth(i).locator(".call-time").inner_text() == "", kind
    raise AssertionError(f"no forced {kind} call ran in {TRIES} tries")


def took(call: Any, least_s: float = 0.0) -> str:
    """The time a call shows: from its in_progress event to its completed or
    failed one, in ms under a second. Coarse bounds: more than ``least_s``
    where the run must take a moment, never minutes."""
    shown: str = call.locator(".call-time").inner_text()
    parts = TIME.match(shown)
    assert parts is not None, shown
    seconds = int(parts.group(1)) / 1000 if parts.group(1) else float(parts.group(2))
    assert least_s <= seconds < 120, shown
    return shown


def fits_a_phone(pg: Any, screens: Path, name: str) -> None:
    """At 390 px neither the page nor the conversation scrolls sideways;
    then back to the desktop size."""
    pg.set_viewport_size(NARROW)
    width = pg.evaluate("() => document.documentElement.scrollWidth")
    assert width <= NARROW["width"], f"the page scrolls sideways at {NARROW['width']}px: {width}"
    inner, shown = pg.locator(".transcript").evaluate("el => [el.scrollWidth, el.clientWidth]")
    assert inner <= shown, f"the conversation scrolls sideways: {inner} px in {shown}"
    shoot(pg, screens, name, full_page=True)
    pg.set_viewport_size(DESKTOP)


def test_tools_that_are_off_are_not_offered(browser: Any, bare: Server) -> None:
    context, pg, watch = new_page(browser, bare.base_url)
    pg.goto(f"{bare.base_url}/#/chat")
    pg.locator(".tool-switch[data-tool=code_interpreter]").wait_for()
    for tool, setting in (("code_interpreter", "code_interpreter"), ("web_search", "web_search_searxng_url"),
                          ("mcp", "mcp_allowed_urls"), ("file_search", "file_search_embedding_model")):
        box = pg.locator(f"#chat-tool-{tool}")
        assert box.is_disabled() and not box.is_checked(), tool
        title = pg.locator(f"label[for=chat-tool-{tool}]").get_attribute("title") or ""
        assert f"setting {setting}" in title, (tool, title)
        row = pg.locator(f".tool-switch[data-tool={tool}]")
        assert row.get_by_text(f"off: set {setting}").is_visible(), tool
    context.close()
    watch.check()


def test_tools_that_are_on_are_offered(page: tuple[Any, Any], server: Server, mcp_url: str) -> None:
    pg, watch = page
    open_chat(pg, server)
    for tool in ("code_interpreter", "web_search", "mcp", "file_search"):
        assert pg.locator(f"#chat-tool-{tool}").is_enabled(), tool
        assert not pg.locator(f".tool-switch[data-tool={tool}] .tool-why").count(), tool
    # MCP offers the server the admin allowed, filled in once switched on.
    url = pg.locator("#chat-mcp-url")
    assert not url.is_visible()
    pg.locator("#chat-tool-mcp").check()
    assert url.is_visible() and url.input_value() == mcp_url
    # File search needs a store to search: sending without one says so.
    pg.locator("#chat-tool-mcp").uncheck()
    pg.locator("#chat-tool-file_search").check()
    pg.locator("#chat-input").fill("Find out")
    pg.get_by_role("button", name="Send").click()
    pg.locator(".form-error", has_text="Name a vector store to search").wait_for()
    assert not pg.locator(".msg.assistant").count()
    watch.check()


def test_a_code_interpreter_call_shows_its_code_logs_and_time(page: tuple[Any, Any], server: Server,
                                                              screens: Path) -> None:
    pg, watch = page
    open_chat(pg, server)
    pg.locator("#chat-tool-code_interpreter").check()
    ran, sent = send_until(pg, "code_interpreter_call", ("completed",))
    assert sent[-1]["tools"] == [{"type": "code_interpreter", "container": {"type": "auto"}}]
    assert sent[-1]["tool_choice"] == "required"

    call_id = ran.get_attribute("data-call-id")
    code = ran.locator(".call-code pre").inner_text()
    logs = ran.locator(".call-logs pre").inner_text()
    assert ran.locator(".call-kind").inner_text() == "code_interpreter"
    assert ran.locator(".call-status").inner_text() == "completed"
    # The sandbox starts a process: never no time at all.
    shown = took(ran, least_s=0.001)
    # What the page shows is what the server ran and stored.
    call = stored(server, pg, "code_interpreter_call")
    assert call["id"] == call_id
    assert code and code == call["code"]
    assert logs == ("".join(o["logs"] for o in call["outputs"] if o["type"] == "logs") or "(no output)")
    shoot(pg, screens, "chat-hosted-code", full_page=True)
    # On a phone the call fits the width: its long code wraps.
    fits_a_phone(pg, screens, "chat-hosted-code-narrow")

    # A saved conversation shows the call again, with its time.
    pg.reload()
    pg.locator(".conversations .conv-open").first.click()
    again = pg.locator(f".hosted-call[data-call-id={call_id}]")
    again.wait_for()
    assert again.locator(".call-code pre").inner_text() == code
    assert again.locator(".call-time").inner_text() == shown
    watch.check()


def test_a_web_search_shows_its_query_and_sources(page: tuple[Any, Any], server: Server,
                                                  search: FakeSearxng, screens: Path) -> None:
    pg, watch = page
    open_chat(pg, server)
    pg.locator("#chat-tool-web_search").check()
    ran, sent = send_until(pg, "web_search_call", ("completed",))
    assert sent[-1]["tools"] == [{"type": "web_search"}]
    query = ran.locator(".call-query pre").inner_text()
    call = stored(server, pg, "web_search_call")
    # The query the model wrote, as the provider was asked it.
    assert query == call["action"]["query"] and query[:1000] in search.queries
    links = ran.locator(".call-sources a")
    shown = [(links.nth(i).inner_text(), links.nth(i).get_attribute("href")) for i in range(links.count())]
    assert shown == [(r["title"], r["url"]) for r in call["results"]]
    assert shown[0] == (RESULTS[0]["title"], RESULTS[0]["url"])
    took(ran)
    shoot(pg, screens, "chat-hosted-search", full_page=True)
    # The summary's long query is cut, not widening the page.
    fits_a_phone(pg, screens, "chat-hosted-search-narrow")
    watch.check()


def test_an_mcp_call_shows_the_tool_its_arguments_and_output(page: tuple[Any, Any], server: Server,
                                                             screens: Path) -> None:
    pg, watch = page
    open_chat(pg, server)
    pg.locator("#chat-tool-mcp").check()
    ran, sent = send_until(pg, "mcp_call", ("completed", "failed"))
    tool = sent[-1]["tools"][0]
    assert tool["type"] == "mcp" and tool["require_approval"] == "never"
    # The server's tools were listed first, then one was called.
    listing = pg.locator(".msg.assistant").last.locator(".hosted-call[data-type=mcp_list_tools]")
    assert listing.locator(".call-kind").inner_text() == "mcp"
    assert ran.locator(".call-kind").inner_text() == "mcp"
    assert "list tools" in listing.locator(".call-subject").inner_text()
    assert "add" in listing.locator(".call-output pre").inner_text().split("\n")
    assert listing.locator(".call-time").inner_text() == ""  # its events come together: no time to show
    call = stored(server, pg, "mcp_call")
    assert ran.get_attribute("data-status") == call["status"]
    assert ran.locator(".call-subject").inner_text().strip() == f"{call['server_label']} · {call['name']}"
    args = ran.locator(".call-args pre").inner_text()
    try:
        assert json.loads(args) == json.loads(call["arguments"])
    except ValueError:
        assert args == call["arguments"]  # not JSON: shown as written
    if call.get("output") is not None:
        assert ran.locator(".call-output pre").inner_text() == call["output"]
    else:
        # A protocol or HTTP error's message, or the text a tool's failure came with.
        error = call["error"]
        said = error.get("message") or "\n".join(c["text"] for c in error.get("content") or [] if "text" in c)
        assert said and ran.locator(".call-error pre").inner_text() == said
    took(ran)
    shoot(pg, screens, "chat-hosted-mcp", full_page=True)
    watch.check()


def test_a_file_search_shows_its_queries_and_the_chunks_found(page: tuple[Any, Any], server: Server,
                                                              store: str, screens: Path) -> None:
    pg, watch = page
    open_chat(pg, server)
    pg.locator("#chat-tool-file_search").check()
    # The stores this sign-in may search are offered to pick from.
    pg.locator(f"#chat-vector-store-list option[value={store}]").wait_for(state="attached")
    assert pg.locator(f"#chat-vector-store-list option[value={store}]").get_attribute("label") == f"heron ({store})"
    pg.locator("#chat-vector-stores").fill(store)
    ran, sent = send_until(pg, "file_search_call", ("completed",))
    assert sent[-1]["tools"] == [{"type": "file_search", "vector_store_ids": [store]}]
    assert sent[-1]["include"] == ["file_search_call.results"]
    call = stored(server, pg, "file_search_call")
    assert ran.locator(".call-query pre").inner_text() == "\n".join(call["queries"])
    found = ran.locator(".call-results li")
    assert found.count() == len(call["results"]) > 0
    first = found.first
    assert first.locator("strong").inner_text() == "heron.md"
    assert first.locator("pre").inner_text() == call["results"][0]["text"]
    assert "heron counts" in call["results"][0]["text"]
    took(ran)
    shoot(pg, screens, "chat-hosted-files", full_page=True)
    watch.check()


def test_a_call_cut_at_the_token_limit_shows_unrun(page: tuple[Any, Any], server: Server) -> None:
    pg, watch = page
    open_chat(pg, server)
    pg.locator("#chat-tool-code_interpreter").check()
    pg.locator("#chat-require-tool").check()
    # Too few tokens for the model to close its code: the call never runs.
    pg.locator("#chat-max-tokens").fill("24")
    pg.locator("#chat-input").fill("Compute")
    pg.get_by_role("button", name="Send").click()
    finished(pg)
    call = pg.locator(".msg.assistant").last.locator(".hosted-call[data-type=code_interpreter_call]")
    call.wait_for()
    assert call.get_attribute("data-status") == "incomplete"
    assert call.locator(".call-status").inner_text() == "incomplete"
    assert call.locator(".call-time").inner_text() == ""
    assert not call.locator(".call-logs").count()
    assert "cut at the token limit" in pg.locator(".msg.assistant .usage").last.inner_text()
    watch.check()
