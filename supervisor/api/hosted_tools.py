"""``GET /api/hosted-tools``: which hosted tools this server runs.

The lab's chat asks before it offers a tool: each of code_interpreter,
web_search, mcp and file_search is listed with whether a request may use it
and, when it may not, why and the setting an admin sets. Each answer is the
same check a request with the tool meets (a refused tool is a 400 there),
read from the running service, so the page never offers what would be
refused. Nothing secret is shown: no search endpoint, and of the MCP
allowlist only the entries that are plain server URLs (an entry with
credentials, a query or a fragment is counted, never echoed).
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

import msgspec
from aiohttp import web

from supervisor.api.io import json_response
from supervisor.appkeys import CONFIG, RESPONSES
from supervisor.config import Config
from supervisor.generation.tools import RUN_HERE
from supervisor.responses.hosted.addresses import url_problem
from supervisor.responses.hosted.code_interpreter import Containers
from supervisor.responses.hosted.searxng import provider_problem

PATH = "/api/hosted-tools"

ToolType = Literal["code_interpreter", "web_search", "mcp", "file_search"]


class HostedToolState(msgspec.Struct, omit_defaults=True):
    type: ToolType
    enabled: bool
    # When off: a sentence saying why, and the setting that turns it on.
    reason: str | None = None
    setting: str | None = None
    # mcp: the allowlist's entries a request may name as its server_url as
    # they are, and how many entries are prefixes or were left out.
    server_urls: list[str] | None = None
    other_entries: int | None = None
    # file_search: the model whose embeddings index the files ("" or None: none).
    embedding_model: str | None = None


def _off(tool: ToolType, reason: str, setting: str) -> HostedToolState:
    return HostedToolState(type=tool, enabled=False, reason=reason, setting=setting)


def code_interpreter_state(containers: Containers) -> HostedToolState:
    if containers.pool is None:
        # The same sentence a request with the tool gets in its 400.
        return _off("code_interpreter", containers.unavailable, "code_interpreter")
    return HostedToolState(type="code_interpreter", enabled=True)


def web_search_state(url: str) -> HostedToolState:
    if not url:
        return _off("web_search", "web search is off: no search endpoint is configured", "web_search_searxng_url")
    if provider_problem(url) is not None:
        # Not the URL itself: it may name an internal host.
        return _off("web_search", "the search endpoint is misconfigured", "web_search_searxng_url")
    return HostedToolState(type="web_search", enabled=True)


def offerable_url(entry: str) -> bool:
    """Whether an allowlist entry can be shown and sent as a server_url as it
    is: http(s), a host, no credentials, no query or fragment (where a token
    could hide), and a request naming it would pass the allowlist."""
    parts = urlsplit(entry)
    return not (parts.query or parts.fragment) and url_problem(entry, (entry,)) is None


def mcp_state(allowed: list[str]) -> HostedToolState:
    if not allowed:
        return _off("mcp", "no MCP server is allowed: the allowlist is empty", "mcp_allowed_urls")
    urls = [entry for entry in allowed if offerable_url(entry)]
    return HostedToolState(type="mcp", enabled=True, server_urls=urls, other_entries=len(allowed) - len(urls))


def file_search_state(embedding_model: str) -> HostedToolState:
    if "file_search" not in RUN_HERE:
        return _off("file_search", "file_search does not run on this server yet", "file_search_embedding_model")
    if not embedding_model:
        return _off("file_search", "no embedding model is configured to index files", "file_search_embedding_model")
    return HostedToolState(type="file_search", enabled=True, embedding_model=embedding_model)


def hosted_states(cfg: Config, containers: Containers) -> list[HostedToolState]:
    return [
        code_interpreter_state(containers),
        web_search_state(cfg.web_search_searxng_url),
        mcp_state(list(cfg.mcp_allowed_urls)),
        file_search_state(cfg.file_search_embedding_model),
    ]


async def hosted_tools(request: web.Request) -> web.Response:
    app = request.app
    states = hosted_states(app[CONFIG], app[RESPONSES].containers)
    return json_response({"object": "list", "data": states})


def add_routes(app: web.Application) -> None:
    app.router.add_get(PATH, hosted_tools)
