"""Talking to one remote MCP server over streamable HTTP, or over the older
HTTP+SSE transport for a URL whose path ends in ``/sse`` (where MCP servers
serve it, beside ``/mcp`` for streamable HTTP), through the official ``mcp``
SDK (imported here only, when a request uses it). The path decides, rather
than trying one transport and then the other, so that each operation is one
connection and a server that fails is not asked twice.

Each operation (list the tools, call one) opens its own connection: no
session outlives the await that uses it, so a cancelled response leaves
nothing open behind it. Every HTTP request, redirects included, must pass
the allowlist (:func:`.addresses.request_allowed`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from supervisor.responses.hosted.addresses import AddressRefused, request_allowed
from supervisor.responses.items import McpToolInfo

# The most output text one call hands the model (and the response stores).
MAX_OUTPUT_CHARS = 256 * 1024


class McpFailed(Exception):
    """The server could not be reached or answered with a protocol error;
    ``error`` is the SDK's ``McpToolCallError`` shape."""

    def __init__(self, message: str, error: dict[str, Any]) -> None:
        super().__init__(message)
        self.error = error


@dataclass
class CallResult:
    output: str | None
    error: dict[str, Any] | None


@dataclass(frozen=True)
class McpServer:
    label: str
    url: str
    headers: dict[str, str]
    allowed: tuple[str, ...]
    timeout_s: float

    @property
    def transport(self) -> str:
        """``sse`` for a URL whose path ends in ``/sse``, else ``streamable_http``."""
        return "sse" if urlsplit(self.url).path.rstrip("/").endswith("/sse") else "streamable_http"

    def _http(self, headers: dict[str, str] | None = None, timeout: Any = None, auth: Any = None) -> Any:
        """An HTTP client whose every request, redirects included, must pass the allowlist."""
        import httpx2

        allowed = self.allowed
        # The SSE stream names the URL its messages are posted to (often
        # /messages/ beside /sse), and the SDK holds it to the stream's own
        # origin: a POST there is allowed once the stream's GET passed.
        parts = urlsplit(self.url)
        posts = (*allowed, f"{parts.scheme}://{parts.netloc}/") if self.transport == "sse" else allowed

        async def check(request: Any) -> None:
            request_allowed(str(request.url), posts if request.method == "POST" else allowed)

        return httpx2.AsyncClient(headers={**self.headers, **(headers or {})},
                                  timeout=timeout or httpx2.Timeout(self.timeout_s), auth=auth,
                                  event_hooks={"request": [check]})

    @asynccontextmanager
    async def _client(self) -> AsyncIterator[Any]:
        from mcp import Client

        if self.transport == "sse":
            from mcp.client.sse import sse_client

            # The SSE stream is one long GET: it may be quiet between
            # events for as long as a call may take.
            link = sse_client(self.url, timeout=self.timeout_s, sse_read_timeout=self.timeout_s,
                              httpx_client_factory=self._http)
            # "legacy": the initialize handshake every MCP server speaks.
            async with Client(link, mode="legacy", read_timeout_seconds=self.timeout_s) as client:
                yield client
            return
        from mcp.client.streamable_http import streamable_http_client

        async with self._http() as http:
            async with Client(streamable_http_client(self.url, http_client=http), mode="legacy",
                              read_timeout_seconds=self.timeout_s) as client:
                yield client

    async def list_tools(self) -> list[McpToolInfo]:
        try:
            async with self._client() as client:
                listed = await client.list_tools()
        except Exception as exc:  # the remote is untrusted: any failure is this server's error
            raise _failure(exc) from exc
        return [McpToolInfo(name=t.name, input_schema=t.input_schema, description=t.description,
                            annotations=t.annotations.model_dump(exclude_none=True) if t.annotations else None)
                for t in listed.tools]

    async def call(self, name: str, arguments: dict[str, Any]) -> CallResult:
        try:
            async with self._client() as client:
                result = await client.call_tool(name, arguments)
        except Exception as exc:  # the remote is untrusted: any failure becomes the call's error
            return CallResult(None, _failure(exc).error)
        parts = [_text(part) for part in result.content]
        text = "\n".join(parts)[:MAX_OUTPUT_CHARS]
        if result.is_error:
            return CallResult(None, {"type": "mcp_tool_execution_error",
                                     "content": [{"type": "text", "text": text}]})
        return CallResult(text, None)


def _text(part: Any) -> str:
    text = getattr(part, "text", None)
    return text if isinstance(text, str) else json.dumps(part.model_dump(mode="json", exclude_none=True))


def _leaf(exc: BaseException) -> BaseException:
    """The first real error inside the task groups' exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _failure(exc: BaseException) -> McpFailed:
    from mcp.shared.exceptions import MCPError

    leaf = _leaf(exc)
    if isinstance(leaf, MCPError):
        return McpFailed(str(leaf), {"type": "mcp_protocol_error", "code": leaf.code, "message": str(leaf)})
    if isinstance(leaf, AddressRefused):
        return McpFailed(str(leaf), {"type": "http_error", "code": 403, "message": str(leaf)})
    status = getattr(getattr(leaf, "response", None), "status_code", None)
    message = f"{type(leaf).__name__}: {leaf}" if str(leaf) else type(leaf).__name__
    return McpFailed(message, {"type": "http_error", "code": status if isinstance(status, int) else 502,
                               "message": message})
