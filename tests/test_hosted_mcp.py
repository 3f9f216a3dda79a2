"""Hosted MCP tools end to end: a real gpuvisor server with a tiny model
whose first generation is forced to call a tool of a real MCP server (made
with the official SDK, tests/mcp_server.py), which the server runs itself,
then answers. Items and events validate strictly as the SDK's types."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai.types.responses import Response, ResponseItem, ResponseStreamEvent
from openai.types.responses.response_output_item import McpCall, McpListTools
from pydantic import TypeAdapter

from supervisor.generation.pieces import ToolCall
from supervisor.models.demo import write_tiny_gguf
from supervisor.responses.hosted.loop import ToolLoop
from supervisor.responses.hosted.mcp_client import McpServer
from supervisor.responses.hosted.session import HostedSession, ServerTools
from supervisor.responses.hosted.settings import HostedSettings
from supervisor.responses.items import McpCallItem
from tests.mcp_support import mcp_server
from tests.server import Server, running, short_tempdir

EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
ITEM: TypeAdapter[Any] = TypeAdapter(ResponseItem)


@pytest.fixture(scope="module")
def mcp_url() -> Iterator[str]:
    with mcp_server() as url:
        yield url


@pytest.fixture(scope="module")
def srv(mcp_url: str) -> Iterator[Server]:
    models = short_tempdir("gvm")
    write_tiny_gguf(models / "tiny.gguf", n_ctx=2048)
    base = mcp_url.rsplit("/", 1)[0]
    env = {"GPUVISOR_N_CTX": "2048", "GPUVISOR_MCP_ALLOWED_URLS": f"{base}/mcp",
           "GPUVISOR_HOSTED_MAX_ITERATIONS": "2", "GPUVISOR_HOSTED_CALL_TIMEOUT_S": "4"}
    with running(Server(models, env=env, model="tiny")) as server:
        yield server


def _tool(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "mcp", "server_label": "calc", "server_url": url, "require_approval": "never",
            "allowed_tools": ["add"], **extra}


def _create(srv: Server, **body: Any) -> httpx.Response:
    # One call per generation: a forced call then ends where the call does.
    head = {"model": "tiny", "max_output_tokens": 120, "parallel_tool_calls": False}
    return httpx.post(f"{srv.base_url}/v1/responses", json={**head, **body}, timeout=120)


def _check_call(call: dict[str, Any]) -> None:
    McpCall.model_validate(call, strict=True)
    args = json.loads(call["arguments"])
    assert (call["server_label"], call["name"], call["status"]) == ("calc", "add", "completed")
    assert call["output"] == str(args["a"] + args["b"])


def test_a_forced_mcp_call_runs_and_the_model_answers(srv: Server, mcp_url: str) -> None:
    reply = _create(srv, input="add two numbers", tools=[_tool(mcp_url)], tool_choice="required")
    assert reply.status_code == 200, reply.text
    body = reply.json()
    Response.model_validate(body, strict=True)
    types = [o["type"] for o in body["output"]]
    assert types[:2] == ["mcp_list_tools", "mcp_call"] and body["status"] in ("completed", "incomplete")
    listing = McpListTools.model_validate(body["output"][0], strict=True)
    assert [t.name for t in listing.tools] == ["add"]  # allowed_tools narrowed the list
    _check_call(body["output"][1])
    # The second generation is free ("auto"): it answered, or called again within the budget of 2.
    assert types[-1] in ("message", "mcp_call")
    # The calls are stored: a follow-up sees them, and its own input (sent back) lists them.
    follow = _create(srv, previous_response_id=body["id"], input="thanks", tools=[_tool(mcp_url)])
    assert follow.status_code == 200, follow.text
    assert "mcp_list_tools" not in [o["type"] for o in follow.json()["output"]]  # reused from history
    stateless = _create(srv, input=[{"role": "user", "content": "again"}, *body["output"][:2]],
                        tools=[_tool(mcp_url)], store=True)
    assert stateless.status_code == 200, stateless.text
    items = httpx.get(f"{srv.base_url}/v1/responses/{stateless.json()['id']}/input_items?order=asc").json()["data"]
    for item in items:
        ITEM.validate_python(item, strict=True)
    assert [i["type"] for i in items] == ["message", "mcp_list_tools", "mcp_call"]


def test_streamed_events_come_in_order(srv: Server, mcp_url: str) -> None:
    body = {"model": "tiny", "max_output_tokens": 120, "parallel_tool_calls": False, "input": "add",
            "tools": [_tool(mcp_url)], "tool_choice": "required", "stream": True}
    with httpx.stream("POST", f"{srv.base_url}/v1/responses", json=body, timeout=120) as reply:
        assert reply.status_code == 200
        events = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: ")]
    for event in events:
        EVENT.validate_python(event, strict=True)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    mcp = [(e["type"], e.get("item_id")) for e in events if ".mcp_" in e["type"]]
    assert [k for k, _ in mcp[:2]] == ["response.mcp_list_tools.in_progress", "response.mcp_list_tools.completed"]
    # Each call (parallel calls too): its arguments, then it runs, then its end;
    # one the token limit cut (incomplete) never runs.
    status = {e["item"]["id"]: e["item"]["status"] for e in events
              if e["type"] == "response.output_item.done" and e["item"]["type"] == "mcp_call"}
    assert "completed" in status.values()
    for item_id, end in status.items():
        ran = ["response.mcp_call.in_progress", "response.mcp_call.completed"] if end == "completed" else []
        assert [k for k, i in mcp if i == item_id] == [
            "response.mcp_call_arguments.delta", "response.mcp_call_arguments.done", *ran]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert sum(k in ("response.completed", "response.incomplete", "response.failed") for k in kinds) == 1
    _check_call(next(e["item"] for e in events if e["type"] == "response.output_item.done"
                     and e["item"]["type"] == "mcp_call"))


def test_the_budget_ends_the_loop_with_an_answer(srv: Server, mcp_url: str) -> None:
    # tool_choice required holds for the first generation only; the limit is 2 rounds.
    reply = _create(srv, input="add", tools=[_tool(mcp_url)], tool_choice="required")
    body = reply.json()
    calls = [o for o in body["output"] if o["type"] == "mcp_call"]
    assert 1 <= len(calls) <= 2 and body["output"][-1]["type"] == "message"
    assert body["usage"]["output_tokens"] > 0


@pytest.mark.parametrize("url,why", [
    ("http://127.0.0.1:9/other", "allowlist"),
    ("http://169.254.169.254/mcp", "allowlist"),
    ("http://127.0.0.1:9/mcp/../x", "dot segments"),
])
def test_urls_outside_the_allowlist_are_refused(srv: Server, url: str, why: str) -> None:
    reply = _create(srv, input="x", tools=[{"type": "function", "name": "f"}, _tool(url)])
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "tools[1].server_url" and why in error["message"]


def test_mcp_is_off_by_default() -> None:
    models = short_tempdir("gvm")
    write_tiny_gguf(models / "tiny.gguf", n_ctx=1024)
    with running(Server(models, model="tiny")) as server:
        reply = _create(server, input="x", tools=[_tool("http://127.0.0.1:9/mcp")])
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "tools[0].server_url"
    assert "mcp_allowed_urls" in reply.json()["error"]["message"]


def test_an_mcp_tool_choice_forces_that_tool(srv: Server, mcp_url: str) -> None:
    choice = {"type": "mcp", "server_label": "calc", "name": "add"}
    reply = _create(srv, input="add", tools=[_tool(mcp_url, allowed_tools=None)], tool_choice=choice)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    Response.model_validate(body, strict=True)
    assert body["tool_choice"] == choice
    _check_call(next(o for o in body["output"] if o["type"] == "mcp_call"))


def test_other_hosted_tool_choices_are_refused_clearly(srv: Server) -> None:
    reply = _create(srv, input="x", tools=[{"type": "image_generation"}], tool_choice={"type": "image_generation"})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "tool_choice.type" and "not enabled" in error["message"]


def test_headers_reach_the_server(srv: Server, mcp_url: str) -> None:
    tool = _tool(mcp_url, allowed_tools=["whoami"], headers={"X-Test": "from-the-client"})
    body = _create(srv, input="who", tools=[tool], tool_choice="required").json()
    call = next(o for o in body["output"] if o["type"] == "mcp_call")
    McpCall.model_validate(call, strict=True)
    assert (call["name"], call["output"]) == ("whoami", "from-the-client"), call


def test_a_call_past_its_time_limit_fails_and_the_loop_goes_on(srv: Server, mcp_url: str) -> None:
    started = time.monotonic()
    body = _create(srv, input="wait", tools=[_tool(mcp_url, allowed_tools=["hang"])], tool_choice="required").json()
    assert time.monotonic() - started < 60  # the 4 s limit stopped it, not the server's hour
    call = next(o for o in body["output"] if o["type"] == "mcp_call")
    McpCall.model_validate(call, strict=True)
    assert call["status"] == "failed" and call["error"]["type"] == "http_error" and call["error"]["code"] == 504
    assert body["status"] in ("completed", "incomplete")


def test_a_cancel_stops_the_running_call(srv: Server, mcp_url: str) -> None:
    body = {"model": "tiny", "max_output_tokens": 120, "parallel_tool_calls": False, "input": "wait",
            "tools": [_tool(mcp_url, allowed_tools=["hang"])],
            "tool_choice": "required", "background": True, "stream": True}
    with httpx.stream("POST", f"{srv.base_url}/v1/responses", json=body, timeout=120) as reply:
        response_id = ""
        for line in reply.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            response_id = response_id or event.get("response", {}).get("id", "")
            if event["type"] == "response.mcp_call.in_progress":
                break
    started = time.monotonic()
    cancelled = httpx.post(f"{srv.base_url}/v1/responses/{response_id}/cancel", timeout=30).json()
    assert cancelled["status"] == "cancelled" and time.monotonic() - started < 3  # not the 4 s call limit
    stored = httpx.get(f"{srv.base_url}/v1/responses/{response_id}", timeout=30).json()
    Response.model_validate(stored, strict=True)
    assert [o["status"] for o in stored["output"] if o["type"] == "mcp_call"] == ["incomplete"]


async def test_a_repeated_call_gets_the_earlier_result(mcp_url: str) -> None:
    server = McpServer("calc", mcp_url, {}, (mcp_url,), 10.0)
    session = HostedSession(HostedSettings(mcp_allowed_urls=(mcp_url,)),
                            servers={"calc": ServerTools(server, [])}, owners={"count": "calc"})
    loop = ToolLoop(session)
    first, again = (session.call_item(ToolCall("count", "{}")) for _ in range(2))
    assert isinstance(first, McpCallItem) and isinstance(again, McpCallItem)
    await loop._result(first)
    await loop._result(again)
    assert again.output == first.output
    # The server ran it once: its next real call counts one more than the first.
    assert (await server.call("count", {})).output == str(int(first.output or "0") + 1)
