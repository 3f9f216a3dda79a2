"""MCP approvals end to end: a real gpuvisor server, the local MCP server
made with the official SDK (tests/mcp_server.py), and a tiny model forced
to call a tool that needs approval. The response ends with an
``mcp_approval_request``; the client's ``mcp_approval_response`` runs the
call (approved) or tells the model it was refused (denied). The ``count``
tool counts its runs, so a test sees whether a call ran. Items and events
validate strictly as the SDK's types."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from openai.types.responses import Response, ResponseItem, ResponseStreamEvent
from openai.types.responses.response_output_item import McpApprovalRequest, McpCall
from pydantic import TypeAdapter

from supervisor.responses.convert import to_messages
from supervisor.responses.hosted.mcp_client import McpServer
from supervisor.responses.items import McpApprovalRequestItem, McpApprovalResponseItem, MessageItem
from tests.server import Server
from tests.test_hosted_mcp import mcp_url, srv  # noqa: F401  (the module's fixtures)

pytestmark = pytest.mark.timeout(300)
EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
ITEM: TypeAdapter[Any] = TypeAdapter(ResponseItem)
TRIES = 8


def _tool(url: str, approval: Any = "always", tools: list[str] | None = None) -> dict[str, Any]:
    return {"type": "mcp", "server_label": "calc", "server_url": url, "require_approval": approval,
            "allowed_tools": tools or ["count"]}


def _create(srv: Server, **body: Any) -> httpx.Response:
    head = {"model": "tiny", "max_output_tokens": 120, "parallel_tool_calls": False}
    return httpx.post(f"{srv.base_url}/v1/responses", json={**head, **body}, timeout=120)


def _asked(srv: Server, tool: dict[str, Any], name: str = "count") -> dict[str, Any]:
    """A response that ends asking to approve a call of ``name``."""
    choice = {"type": "mcp", "server_label": "calc", "name": name}
    for _ in range(TRIES):
        reply = _create(srv, input="count", tools=[tool], tool_choice=choice)
        assert reply.status_code == 200, reply.text
        body: dict[str, Any] = reply.json()
        if body["output"][-1]["type"] == "mcp_approval_request":
            return body
        # A forced call the token limit cut is an incomplete mcp_call that never asks.
        assert [o["status"] for o in body["output"] if o["type"] == "mcp_call"] == ["incomplete"], body
    raise AssertionError(f"no forced call was written whole in {TRIES} tries")


async def _count(url: str) -> int:
    """How many times ``count`` ran, this call included."""
    result = await McpServer("calc", url, {}, (url,), 10.0).call("count", {})
    return int(result.output or "0")


async def test_an_approved_call_runs_when_the_conversation_goes_on(srv: Server, mcp_url: str) -> None:
    tool = _tool(mcp_url)
    body = _asked(srv, tool)
    Response.model_validate(body, strict=True)
    assert body["status"] == "completed"
    request = McpApprovalRequest.model_validate(body["output"][-1], strict=True)
    assert (request.server_label, request.name, json.loads(request.arguments)) == ("calc", "count", {})
    assert not [o for o in body["output"] if o["type"] == "mcp_call"]  # nothing ran while it waited
    before = await _count(mcp_url)
    answer = {"type": "mcp_approval_response", "approval_request_id": request.id, "approve": True}
    reply = _create(srv, previous_response_id=body["id"], input=[answer], tools=[tool])
    assert reply.status_code == 200, reply.text
    after = reply.json()
    Response.model_validate(after, strict=True)
    call = McpCall.model_validate(after["output"][0], strict=True)
    assert (call.approval_request_id, call.name, call.status) == (request.id, "count", "completed")
    assert call.output == str(before + 1)  # it ran once, after our own count
    # The model went on after it: an answer, or a new call that asks again.
    assert after["output"][-1]["type"] in ("message", "mcp_approval_request")
    items = httpx.get(f"{srv.base_url}/v1/responses/{after['id']}/input_items", timeout=30).json()["data"]
    for item in items:
        ITEM.validate_python(item, strict=True)
    assert [(i["type"], i["approve"]) for i in items] == [("mcp_approval_response", True)]
    # Answered again, the request does not run twice.
    again = _create(srv, previous_response_id=after["id"], input=[answer], tools=[tool], max_output_tokens=1)
    assert again.status_code == 200, again.text
    assert not [o for o in again.json()["output"] if o["type"] == "mcp_call"]


async def test_a_denied_call_does_not_run_and_the_model_answers(srv: Server, mcp_url: str) -> None:
    tool = _tool(mcp_url)
    body = _asked(srv, tool)
    request = body["output"][-1]
    before = await _count(mcp_url)
    answer = {"type": "mcp_approval_response", "approval_request_id": request["id"], "approve": False,
              "reason": "not now"}
    reply = _create(srv, previous_response_id=body["id"], input=[answer], tools=[tool])
    assert reply.status_code == 200, reply.text
    after = reply.json()
    Response.model_validate(after, strict=True)
    assert after["status"] in ("completed", "incomplete") and after["output"]
    assert not [o for o in after["output"] if o.get("approval_request_id") == request["id"]]
    assert await _count(mcp_url) == before + 1  # only our own count ran


def test_the_model_reads_the_refusal() -> None:
    request = McpApprovalRequestItem(server_label="calc", name="count", arguments="{}", id="mcpr_1")
    denied = McpApprovalResponseItem(approval_request_id="mcpr_1", approve=False, reason="not now", id="mcpa_1")
    messages = to_messages([MessageItem(role="user", content="count"), request], [denied], None)
    assert [m.role for m in messages] == ["user", "assistant", "tool"]
    assert messages[1].tool_calls and messages[1].tool_calls[0]["id"] == "mcpr_1"
    assert messages[2].tool_call_id == "mcpr_1" and "did not approve" in str(messages[2].content)
    assert "not now" in str(messages[2].content)


def test_a_never_filter_runs_its_tools_and_asks_for_the_others(srv: Server, mcp_url: str) -> None:
    tool = _tool(mcp_url, {"never": {"tool_names": ["add"]}}, ["add", "count"])
    for _ in range(TRIES):
        body = _create(srv, input="add", tools=[tool], tool_choice={"type": "mcp", "server_label": "calc",
                                                                   "name": "add"}).json()
        Response.model_validate(body, strict=True)
        calls = [o for o in body["output"] if o["type"] == "mcp_call" and o["status"] != "incomplete"]
        if calls:
            assert calls[0]["name"] == "add" and calls[0]["status"] == "completed"
            assert calls[0]["approval_request_id"] is None
            break
    else:
        raise AssertionError(f"no forced add call ran in {TRIES} tries")
    asked = _asked(srv, tool, "count")
    assert asked["output"][-1]["name"] == "count"


def test_streamed_approval_request_ends_the_response(srv: Server, mcp_url: str) -> None:
    request = {"model": "tiny", "max_output_tokens": 120, "parallel_tool_calls": False, "input": "count",
               "tools": [_tool(mcp_url)], "tool_choice": "required", "stream": True}
    for _ in range(TRIES):
        with httpx.stream("POST", f"{srv.base_url}/v1/responses", json=request, timeout=120) as reply:
            assert reply.status_code == 200
            events = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: ")]
        for event in events:
            EVENT.validate_python(event, strict=True)
        asks = [e for e in events if e.get("item", {}).get("type") == "mcp_approval_request"]
        if not asks:
            continue
        assert [e["type"] for e in asks] == ["response.output_item.added", "response.output_item.done"]
        assert events[-1]["type"] == "response.completed"
        final = events[-1]["response"]
        assert final["output"][-1]["id"] == asks[0]["item"]["id"]
        assert not [e for e in events if e["type"].startswith("response.mcp_call.")]
        return
    raise AssertionError(f"no forced call was written whole in {TRIES} tries")


def test_bad_approvals_are_refused_naming_the_field(srv: Server, mcp_url: str) -> None:
    unknown = {"type": "mcp_approval_response", "approval_request_id": "mcpr_nope", "approve": True}
    cases: list[tuple[dict[str, Any], str]] = [
        (dict(input=[{"role": "user", "content": "x"}, unknown], tools=[_tool(mcp_url)]),
         "input[1].approval_request_id"),
        (dict(input="x", tools=[_tool(mcp_url, {"sometimes": {}})]), "tools[0].require_approval"),
        (dict(input="x", tools=[_tool(mcp_url, {"never": {"tool_names": "add"}})]),
         "tools[0].require_approval.never.tool_names"),
    ]
    # An approval sent back with its request, but without the server in tools.
    request = {"type": "mcp_approval_request", "id": "mcpr_1", "server_label": "calc", "name": "count",
               "arguments": "{}"}
    cases.append((dict(input=[request, {**unknown, "approval_request_id": "mcpr_1"}]),
                  "input[1].approval_request_id"))
    for body, param in cases:
        for background in (False, True):  # a background request is refused before it is queued
            reply = _create(srv, **body, background=background)
            assert reply.status_code == 400, (param, reply.text)
            assert reply.json()["error"]["param"] == param, reply.text


async def test_the_agents_sdk_approves_through_its_hook(srv: Server, mcp_url: str) -> None:
    agents = pytest.importorskip("agents", reason="the openai-agents package (test extra) is not installed")
    from tests.test_clients_sdk import Capture

    asked: list[str] = []

    def approve(request: Any) -> Any:
        asked.append(request.data.name)
        return {"approve": True}

    capture = Capture()
    client = capture.async_client(srv.base_url)
    model = agents.OpenAIResponsesModel(model=srv.model, openai_client=client)
    settings = agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=120)
    tool = agents.HostedMCPTool(tool_config=_tool(mcp_url), on_approval_request=approve)
    agent = agents.Agent(name="counter", instructions="Count.", tools=[tool], model=model, model_settings=settings)
    config = agents.RunConfig(tracing_disabled=True)
    before = await _count(mcp_url)
    calls: list[Any] = []
    for _ in range(TRIES):
        asked.clear()
        # Turn 1 ends with the approval request; the hook approves; turn 2 runs the call first. The
        # random model then writes on (its tool_choice reset to auto) and may run past max_tokens:
        # the turns that ran are in the error's run data.
        try:
            items = (await agents.Runner.run(agent, "count", run_config=config, max_turns=2)).new_items
        except (agents.MaxTurnsExceeded, agents.ModelBehaviorError) as exc:
            items = exc.run_data.new_items if exc.run_data is not None else []
        calls = [i.raw_item for i in items
                 if isinstance(i, agents.ToolCallItem) and getattr(i.raw_item, "type", "") == "mcp_call"]
        if asked and calls:
            break
    await client.close()
    assert asked and asked[0] == "count", "the hook was never asked"
    assert calls, f"no approved call ran in {TRIES} tries"
    assert calls[0].approval_request_id and calls[0].status == "completed"
    assert int(calls[0].output or "0") > before  # it ran on the server once the hook approved it
    assert capture.validate() > 0
