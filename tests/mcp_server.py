"""A small MCP server for tests, made with the official SDK: ``python -m
tests.mcp_server`` serves streamable HTTP on 127.0.0.1 (a free port) at
``/mcp`` (``--sse``: the HTTP+SSE transport at ``/sse``) and prints
``port <n>`` once it listens. It records the headers each
call came with, so tests can see what a client sent; ``hang`` sleeps until
cancelled, for tests that stop a running call; ``count`` counts its calls."""

from __future__ import annotations

import asyncio
import socket
import sys

import uvicorn
from mcp.server.mcpserver import Context, MCPServer

server = MCPServer("test-tools")


@server.tool(description="Add two integers.")
def add(a: int, b: int) -> str:
    return str(a + b)


@server.tool(description="Echo the X-Test header the call came with.")
def whoami(ok: bool, ctx: Context) -> str:
    request = ctx.request_context.request
    headers = getattr(request, "headers", {}) or {}
    return str(headers.get("x-test", ""))


@server.tool(description="Never returns (until the call is cancelled).")
async def hang(ok: bool) -> str:
    await asyncio.sleep(3600)
    return "woke"


COUNT = [0]


@server.tool(description="How many times it was called.")
def count() -> str:
    COUNT[0] += 1
    return str(COUNT[0])


@server.tool(description="Always fails.")
def broken() -> str:
    raise RuntimeError("this tool always fails")


def _closed_schemas() -> None:
    """Close every tool's input schema (additionalProperties: false), as
    many servers' SDKs write them: a forced call then ends once the tool's
    own arguments are written, even from a tiny model's random weights."""
    for tool in server._tool_manager.list_tools():
        tool.parameters["additionalProperties"] = False


def main() -> None:
    _closed_schemas()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    # --sse: the older HTTP+SSE transport, at /sse (messages posted to /messages/).
    if "--sse" in sys.argv[1:]:
        app = server.sse_app()
    else:
        app = server.streamable_http_app(stateless_http=True, json_response=True)
    config = uvicorn.Config(app, log_level="warning")
    print(f"port {sock.getsockname()[1]}", flush=True)
    uvicorn.Server(config).run(sockets=[sock])
    sys.exit(0)


if __name__ == "__main__":
    main()
