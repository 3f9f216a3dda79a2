"""``GET /api/hosted-tools`` on a real service: what the lab's chat learns
before it offers a hosted tool. Off by default, each tool names the setting
that turns it on; configured, it is on, with what a page needs to offer it
(the MCP servers it may name) and nothing secret (no search endpoint, no
allowlist entry with credentials or a query). A code_interpreter whose
sandbox works is on, and a request with the tool is then accepted, as the
endpoint says. Same auth as the other /api reads."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from supervisor.generation.tools import RUN_HERE
from tests.sandbox_support import find_python
from tests.server import REPO, Server, running, short_tempdir

pytestmark = pytest.mark.timeout(120)
ADMIN = "hosted-tools-admin-token"
SEARCH = "http://127.0.0.1:9/searx/search"  # never asked: listing the tools contacts nothing
MCP_URLS = [
    "http://127.0.0.1:8123/mcp",
    "https://tools.example.com/mcp/",
    "https://robot:hunter2@mcp.example.com/mcp",  # credentials: counted, never shown
    "https://mcp.example.org/mcp?token=sekrit",  # a query may hold a token: counted, never shown
]


def _tools(srv: Server, **headers: str) -> dict[str, dict[str, Any]]:
    reply = httpx.get(f"{srv.base_url}/api/hosted-tools", headers=headers, timeout=30)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "list"
    return {t["type"]: t for t in body["data"]}


@pytest.fixture(scope="module")
def plain() -> Iterator[Server]:
    # No model: the endpoint needs none, and no worker starts.
    with running(Server(short_tempdir("gvm"))) as srv:
        yield srv


@pytest.fixture(scope="module")
def configured() -> Iterator[Server]:
    python, _ = find_python()
    env = {"GPUVISOR_ADMIN_TOKEN": ADMIN, "GPUVISOR_WEB_SEARCH_SEARXNG_URL": SEARCH,
           "GPUVISOR_MCP_ALLOWED_URLS": ",".join(MCP_URLS),
           "GPUVISOR_FILE_SEARCH_EMBEDDING_MODEL": "tiny-embed"}
    if python is not None:
        env |= {"GPUVISOR_CODE_INTERPRETER": "true", "GPUVISOR_CODE_INTERPRETER_PYTHON": python}
    with running(Server(short_tempdir("gvm"), env=env)) as srv:
        yield srv


def test_every_tool_is_off_by_default_and_names_its_setting(plain: Server) -> None:
    tools = _tools(plain)
    assert list(tools) == ["code_interpreter", "web_search", "mcp", "file_search"]
    assert not any(t["enabled"] for t in tools.values())
    settings = {name: t["setting"] for name, t in tools.items()}
    assert settings == {"code_interpreter": "code_interpreter", "web_search": "web_search_searxng_url",
                        "mcp": "mcp_allowed_urls", "file_search": "file_search_embedding_model"}
    for t in tools.values():
        assert t["reason"], t
    assert "server_urls" not in tools["mcp"]
    # The page's reason is the request's: a request insisting on the tool is refused with it.
    refused = httpx.post(f"{plain.base_url}/v1/responses", timeout=30, json={
        "model": "any", "input": "hi", "tools": [{"type": "code_interpreter", "container": {"type": "auto"}}],
        "tool_choice": {"type": "code_interpreter"}})
    assert refused.status_code == 400, refused.text
    assert tools["code_interpreter"]["reason"] in refused.json()["error"]["message"]


def test_configured_tools_are_on_with_what_the_page_offers(configured: Server) -> None:
    tools = _tools(configured, Authorization=f"Bearer {ADMIN}")
    assert tools["web_search"] == {"type": "web_search", "enabled": True}
    mcp = tools["mcp"]
    assert mcp["enabled"] is True
    assert mcp["server_urls"] == MCP_URLS[:2]
    assert mcp["other_entries"] == 2
    file_search = tools["file_search"]
    if "file_search" in RUN_HERE:
        assert file_search == {"type": "file_search", "enabled": True, "embedding_model": "tiny-embed"}
    else:
        # Accepted and ignored by the loop until it runs here: never offered.
        assert file_search["enabled"] is False and "does not run" in file_search["reason"]


def test_no_secret_is_shown(configured: Server) -> None:
    text = httpx.get(f"{configured.base_url}/api/hosted-tools", timeout=30,
                     headers={"Authorization": f"Bearer {ADMIN}"}).text
    for secret in ("hunter2", "robot", "sekrit", "9/searx", ADMIN):
        assert secret not in text


def test_a_working_sandbox_is_offered_and_accepted(configured: Server) -> None:
    python, reasons = find_python()
    if python is None:
        pytest.skip("no sandbox on this machine: " + "; ".join(reasons))
    tools = _tools(configured, Authorization=f"Bearer {ADMIN}")
    assert tools["code_interpreter"] == {"type": "code_interpreter", "enabled": True}


def test_same_auth_as_the_other_api_reads(configured: Server) -> None:
    url = f"{configured.base_url}/api/hosted-tools"
    assert httpx.get(url, timeout=30).status_code == 401
    # Any API key reads it, as it reads /api/models: its chat may offer the tools too.
    added = subprocess.run([sys.executable, "-m", "supervisor", "keys", "add", "lab-user", "--state-dir",
                            str(configured.state_dir)], capture_output=True, text=True, cwd=REPO, timeout=60,
                           check=False)
    assert added.returncode == 0, added.stderr
    assert _tools(configured, Authorization=f"Bearer {added.stdout.strip()}")["mcp"]["enabled"] is True
    assert httpx.get(url, timeout=30, headers={"Authorization": "Bearer wrong"}).status_code == 401
    # A read: an admin's POST gets no route, as any other method would.
    assert httpx.post(url, json={}, timeout=30, headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 405
