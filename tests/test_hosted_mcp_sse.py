"""The HTTP+SSE transport of MCP: a server URL whose path ends in /sse is
spoken to over SSE (the stream, then messages posted where it says), through
the official SDK, with the same allowlist rules as streamable HTTP; end to
end, a forced call through the service runs on the SSE server."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from openai.types.responses import Response
from openai.types.responses.response_output_item import McpCall

from supervisor.models.demo import write_tiny_gguf
from supervisor.responses.hosted.mcp_client import McpFailed, McpServer
from tests.mcp_support import mcp_server
from tests.server import Server, running, short_tempdir


@pytest.fixture(scope="module")
def sse_url() -> Iterator[str]:
    with mcp_server(sse=True) as url:
        yield url


async def test_tools_are_listed_and_called_over_sse(sse_url: str) -> None:
    server = McpServer("calc", sse_url, {}, (sse_url,), 10.0)
    assert server.transport == "sse"
    names = [t.name for t in await server.list_tools()]
    assert {"add", "count", "broken"} <= set(names)
    result = await server.call("add", {"a": 2, "b": 40})
    assert (result.output, result.error) == ("42", None)
    failed = await server.call("broken", {})
    assert failed.output is None and failed.error is not None
    assert failed.error["type"] == "mcp_tool_execution_error"


async def test_an_sse_url_outside_the_allowlist_is_refused(sse_url: str) -> None:
    other = sse_url.replace("/sse", "/elsewhere")
    with pytest.raises(McpFailed) as err:
        await McpServer("calc", sse_url, {}, (other,), 10.0).list_tools()
    assert err.value.error["type"] == "http_error" and err.value.error["code"] == 403


def test_a_forced_call_through_the_service_runs_over_sse(sse_url: str) -> None:
    models = short_tempdir("gvm")
    write_tiny_gguf(models / "tiny.gguf", n_ctx=2048)
    env = {"GPUVISOR_N_CTX": "2048", "GPUVISOR_MCP_ALLOWED_URLS": sse_url,
           "GPUVISOR_HOSTED_MAX_ITERATIONS": "1", "GPUVISOR_HOSTED_CALL_TIMEOUT_S": "10"}
    tool = {"type": "mcp", "server_label": "calc", "server_url": sse_url, "require_approval": "never",
            "allowed_tools": ["add"]}
    with running(Server(models, env=env, model="tiny")) as srv:
        reply = httpx.post(f"{srv.base_url}/v1/responses", timeout=120, json={
            "model": "tiny", "max_output_tokens": 120, "parallel_tool_calls": False, "input": "add two numbers",
            "tools": [tool], "tool_choice": "required"})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    Response.model_validate(body, strict=True)
    calls = [o for o in body["output"] if o["type"] == "mcp_call"]
    assert calls, body["output"]
    call = McpCall.model_validate(calls[0], strict=True)
    args = json.loads(call.arguments)
    assert call.status == "completed" and call.output == str(args["a"] + args["b"])
