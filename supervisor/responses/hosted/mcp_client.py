"""Talking to one remote MCP server over streamable HTTP, through the
official ``mcp`` SDK (imported here only, when a request uses it).

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

    @asynccontextmanager
    async def _client(self) -> AsyncIterator[Any]:
        import httpx2
        from mcp import Client
        from mcp.client.streamable_http import streamable_http_client

        allowed = self.allowed

        async def check(request: Any) -> None:
            request_allowed(str(request.url), allowed)

        http = httpx2.AsyncClient(headers=self.headers, timeout=httpx2.Timeout(self.timeout_s),
                                  event_hooks={"request": [check]})
        async with http:
            # "legacy": the initialize handshake every MCP server speaks.
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
