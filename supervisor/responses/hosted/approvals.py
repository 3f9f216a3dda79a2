"""MCP approvals: which calls wait for the user, and what the user said.

An ``mcp`` tool's ``require_approval`` is ``"never"``, ``"always"`` (also
what it is when left out, as at OpenAI) or filters:
``{"never": {"tool_names": [...], "read_only": ...}, "always": {...}}``. A
tool a ``never`` filter names runs without asking; every other tool asks.
A call that asks becomes an ``mcp_approval_request`` item and the response
ends with it. The client goes on (``previous_response_id``, or the items
sent back) with an ``mcp_approval_response`` item: approved, the call runs
before the next generation, as an ``mcp_call`` naming the request; denied,
the model reads that the user refused it, and answers.
"""

from __future__ import annotations

from typing import Any

from supervisor.errors import BadRequest
from supervisor.generation.tools import McpTool
from supervisor.responses.items import (
    Item,
    McpApprovalRequestItem,
    McpApprovalResponseItem,
    McpCallItem,
    McpToolInfo,
    new_id,
)

_FILTER_KEYS = frozenset({"tool_names", "read_only"})


def _checked_filter(raw: Any, param: str) -> dict[str, Any]:
    if not isinstance(raw, dict) or not set(raw) <= _FILTER_KEYS:
        raise BadRequest("an approval filter is an object with tool_names and/or read_only", param=param)
    names = raw.get("tool_names")
    if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise BadRequest("tool_names is a list of tool names", param=f"{param}.tool_names")
    if raw.get("read_only") is not None and not isinstance(raw["read_only"], bool):
        raise BadRequest("read_only is true or false", param=f"{param}.read_only")
    return raw


def check_policy(tool: McpTool, param: str) -> None:
    """A 400 naming ``param`` for a ``require_approval`` of no known shape."""
    policy = tool.require_approval
    if not isinstance(policy, dict):
        return  # "always", "never" or left out: msgspec checked the strings
    if not policy or not set(policy) <= {"always", "never"}:
        raise BadRequest("require_approval is \"always\", \"never\" or {\"always\": {...}, \"never\": {...}}",
                         param=param)
    for key, raw in policy.items():
        _checked_filter(raw, f"{param}.{key}")


def _matches(raw: Any, tool: McpToolInfo) -> bool:
    """Whether an approval filter names ``tool`` (a filter naming nothing names no tool)."""
    if not isinstance(raw, dict) or (raw.get("tool_names") is None and raw.get("read_only") is None):
        return False
    names, read_only = raw.get("tool_names"), raw.get("read_only")
    hint = bool((tool.annotations or {}).get("readOnlyHint")) if isinstance(tool.annotations, dict) else False
    return (names is None or tool.name in names) and (read_only is None or hint == read_only)


def asks(tool: McpTool, info: McpToolInfo) -> bool:
    """Whether a call of ``info`` waits for the user's approval."""
    policy = tool.require_approval
    if policy == "never":
        return False
    if isinstance(policy, dict):
        return not _matches(policy.get("never"), info)
    return True


def request_item(server_label: str, name: str, arguments: str) -> McpApprovalRequestItem:
    return McpApprovalRequestItem(server_label=server_label, name=name, arguments=arguments, id=new_id("mcpr"))


def approved_calls(history: list[Item], items: list[Item], labels: set[str]) -> list[McpCallItem]:
    """The calls this request's approvals let run, in their order; a 400
    names an answer to no request, or to a server not in ``tools``."""
    conversation = [*history, *items]
    requests = {it.id: it for it in conversation if isinstance(it, McpApprovalRequestItem)}
    ran = {it.approval_request_id for it in conversation if isinstance(it, McpCallItem) and it.approval_request_id}
    calls: list[McpCallItem] = []
    for k, item in enumerate(items):
        if not isinstance(item, McpApprovalResponseItem):
            continue
        param = f"input[{k}].approval_request_id"
        request = requests.get(item.approval_request_id)
        if request is None:
            raise BadRequest(f"no mcp_approval_request {item.approval_request_id!r} in this conversation",
                             param=param)
        if not item.approve or request.id in ran:
            continue  # denied (the model reads so), or already run by an earlier answer
        if request.server_label not in labels:
            raise BadRequest(f"the approved call is to MCP server {request.server_label!r}, which is not in tools",
                             param=param)
        ran.add(request.id)
        calls.append(McpCallItem(server_label=request.server_label, name=request.name, arguments=request.arguments,
                                 approval_request_id=request.id, id=new_id("mcp"), status="in_progress"))
    return calls

