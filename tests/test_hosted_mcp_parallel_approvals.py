"""MCP approvals when one generation makes several calls: each call that
needs approval becomes its own ``mcp_approval_request``, none runs while
they wait, and the next request's answers run exactly the approved ones
(a denied one never reaches the server) before the model goes on. End to
end with a real gpuvisor server, the local MCP server made with the
official SDK (tests/mcp_server.py, whose ``count`` tool counts its runs)
and a tiny model forced to call with parallel calls allowed; the session
and approval logic also without a model. Items validate strictly as the
SDK's types."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from openai.types.responses import Response, ResponseItem, ResponseStreamEvent
from openai.types.responses.response_output_item import McpApprovalRequest, McpCall
from pydantic import TypeAdapter

from supervisor.errors import BadRequest
from supervisor.generation.pieces import ToolCall
from supervisor.responses.hosted.approvals import approved_calls
from supervisor.responses.hosted.mcp_client import McpServer
from supervisor.responses.hosted.session import HostedSession, ServerTools
from supervisor.responses.hosted.settings import HostedSettings
from supervisor.responses.items import (
    Item,
    McpApprovalRequestItem,
    McpApprovalResponseItem,
    McpToolInfo,
    MessageItem,
    encode_item,
)
from tests.server import Server
from tests.test_hosted_mcp import mcp_url, srv  # noqa: F401  (the module's fixtures)

pytestmark = pytest.mark.timeout(300)
EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
ITEM: TypeAdapter[Any] = TypeAdapter(ResponseItem)
# The random model wrote two or more whole calls in 33 of 40 tries (measured); tries to see some.
TRIES = 16
TOOL_INFO = McpToolInfo(name="count", input_schema={"type": "object", "properties": {}})


def _tool(url: str) -> dict[str, Any]:
    return {"type": "mcp", "server_label": "calc", "server_url": url, "require_approval": "always",
            "allowed_tools": ["count"]}


def _create(srv: Server, **body: Any) -> httpx.Response:
    head = {"model": "tiny", "max_output_tokens": 200}
    return httpx.post(f"{srv.base_url}/v1/responses", json={**head, **body}, timeout=120)


def _count(url: str) -> int:
    """How many times ``count`` ran, this call included."""
    result = asyncio.run(McpServer("calc", url, {}, (url,), 10.0).call("count", {}))
    return int(result.output or "0")


def _requests(body: dict[str, Any]) -> list[McpApprovalRequest]:
    return [McpApprovalRequest.model_validate(o, strict=True) for o in body["output"]
            if o["type"] == "mcp_approval_request"]


def _asked_several(srv: Server, url: str) -> tuple[dict[str, Any], list[McpApprovalRequest]]:
    """A response whose one generation asked to approve two or more calls."""
    for k in range(TRIES):
        before = _count(url)
        # A prompt of its own each try: the same one may sample the same calls again.
        reply = _create(srv, input=f"count twice ({k})", tools=[_tool(url)], tool_choice="required",
                        parallel_tool_calls=True, max_output_tokens=400)
        assert reply.status_code == 200, reply.text
        body: dict[str, Any] = reply.json()
        Response.model_validate(body, strict=True)
        asked = _requests(body)
        # Nothing ran while they wait: no mcp_call in the output, and the server counted only our own call.
        assert not [o for o in body["output"] if o["type"] == "mcp_call" and o["status"] == "completed"]
        assert _count(url) == before + 1
        if len(asked) >= 2:
            return body, asked
    raise AssertionError(f"no generation made two whole calls in {TRIES} tries")


def test_each_parallel_call_asks_and_only_the_approved_ones_run(srv: Server, mcp_url: str) -> None:
    body, asked = _asked_several(srv, mcp_url)
    # Incomplete too where the token limit cut a further call short: the whole ones still ask.
    assert body["status"] in ("completed", "incomplete")
    assert len({r.id for r in asked}) == len(asked)  # one request each
    assert all((r.server_label, r.name) == ("calc", "count") for r in asked)
    # Approve the first, deny the others.
    answers = [{"type": "mcp_approval_response", "approval_request_id": r.id, "approve": k == 0,
                **({} if k == 0 else {"reason": "once is enough"})} for k, r in enumerate(asked)]
    before = _count(mcp_url)
    reply = _create(srv, previous_response_id=body["id"], input=answers, tools=[_tool(mcp_url)])
    assert reply.status_code == 200, reply.text
    after = reply.json()
    Response.model_validate(after, strict=True)
    # (A further call the token limit cut short is an incomplete mcp_call that never ran nor asked.)
    ran = [McpCall.model_validate(o, strict=True) for o in after["output"]
           if o["type"] == "mcp_call" and o["status"] != "incomplete"]
    assert [(c.approval_request_id, c.status) for c in ran] == [(asked[0].id, "completed")]
    assert ran[0].output == str(before + 1)  # it ran once, after our own count
    assert _count(mcp_url) == before + 2  # and the denied ones never did
    assert after["output"][-1]["type"] in ("message", "mcp_approval_request", "mcp_call")
    items = httpx.get(f"{srv.base_url}/v1/responses/{after['id']}/input_items?order=asc", timeout=30).json()["data"]
    for item in items:
        ITEM.validate_python(item, strict=True)
    assert [(i["approval_request_id"], i["approve"]) for i in items] == [(r.id, k == 0) for k, r in enumerate(asked)]


def test_denying_them_all_runs_none_and_streams_an_answer(srv: Server, mcp_url: str) -> None:
    body, asked = _asked_several(srv, mcp_url)
    answers = [{"type": "mcp_approval_response", "approval_request_id": r.id, "approve": False} for r in asked]
    before = _count(mcp_url)
    request = {"model": "tiny", "max_output_tokens": 60, "previous_response_id": body["id"], "input": answers,
               "tools": [_tool(mcp_url)], "stream": True}
    with httpx.stream("POST", f"{srv.base_url}/v1/responses", json=request, timeout=120) as reply:
        assert reply.status_code == 200
        events = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: ")]
    for event in events:
        EVENT.validate_python(event, strict=True)
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    assert not [e for e in events if e["type"] in ("response.mcp_call.in_progress", "response.mcp_call.completed")]
    assert _count(mcp_url) == before + 1


def test_a_request_left_unanswered_does_not_run(srv: Server, mcp_url: str) -> None:
    body, asked = _asked_several(srv, mcp_url)
    answer = {"type": "mcp_approval_response", "approval_request_id": asked[1].id, "approve": True}
    before = _count(mcp_url)
    reply = _create(srv, previous_response_id=body["id"], input=[answer], tools=[_tool(mcp_url)])
    assert reply.status_code == 200, reply.text
    after = reply.json()
    Response.model_validate(after, strict=True)
    ran = [o for o in after["output"] if o["type"] == "mcp_call" and o["status"] != "incomplete"]
    assert [c["approval_request_id"] for c in ran] == [asked[1].id]
    assert _count(mcp_url) == before + 2


def _session() -> HostedSession:
    session = HostedSession(HostedSettings(mcp_allowed_urls=("http://127.0.0.1:9/mcp",)))
    server = McpServer("calc", "http://127.0.0.1:9/mcp", {}, ("http://127.0.0.1:9/mcp",), 10.0)
    session.servers["calc"] = ServerTools(server, [TOOL_INFO], None, frozenset({"count"}))
    session.owners["count"] = "calc"
    return session


def test_a_generations_calls_each_get_a_request_and_none_waits_to_run() -> None:
    session = _session()
    made = [session.call_item(ToolCall("count", "{}")), session.call_item(ToolCall("count", '{"n": 2}'))]
    assert all(isinstance(m, McpApprovalRequestItem) for m in made)
    assert made[0].id != made[1].id and session.asked and session.take_pending() == []
    for item in made:
        McpApprovalRequest.model_validate_json(encode_item(item), strict=True)


def test_answers_run_the_approved_requests_in_order() -> None:
    requests = [McpApprovalRequestItem(server_label="calc", name="count", arguments=f'{{"n": {k}}}', id=f"mcpr_{k}")
                for k in range(3)]
    history: list[Item] = [MessageItem(role="user", content="count"), *requests]

    def answer(k: int, approve: bool) -> McpApprovalResponseItem:
        return McpApprovalResponseItem(approval_request_id=f"mcpr_{k}", approve=approve, id=f"mcpa_{k}")

    calls = approved_calls(history, [answer(2, True), answer(0, False), answer(1, True)], {"calc"})
    assert [(c.approval_request_id, c.arguments) for c in calls] == [("mcpr_2", '{"n": 2}'), ("mcpr_1", '{"n": 1}')]
    assert len({c.id for c in calls}) == 2 and all(c.status == "in_progress" for c in calls)
    # An answer to a request of no server in tools, or to no request, is a 400 naming it.
    with pytest.raises(BadRequest) as refused:
        approved_calls(history, [answer(0, True)], set())
    assert refused.value.param == "input[0].approval_request_id"
    with pytest.raises(BadRequest) as unknown:
        approved_calls(history, [answer(0, True), answer(7, True)], {"calc"})
    assert unknown.value.param == "input[1].approval_request_id"


def test_the_same_request_answered_twice_runs_once() -> None:
    request = McpApprovalRequestItem(server_label="calc", name="count", arguments="{}", id="mcpr_1")
    yes = McpApprovalResponseItem(approval_request_id="mcpr_1", approve=True, id="mcpa_1")
    assert len(approved_calls([request], [yes, yes], {"calc"})) == 1
