"""One response's hosted tools: checked, set up and offered as functions.

:func:`open_session` runs before the first generation: it refuses what
this server does not do (approval flows, connectors, a tool that is off)
or may not reach (the allowlist) with a 400 naming the tool, lists each
MCP server's tools (or reuses an ``mcp_list_tools`` item the conversation
already holds), finds the code_interpreter's container
(:mod:`.code_interpreter`), sets up web_search (:mod:`.web_search`) and
file_search (:mod:`.file_search`) and returns the request with those tools
offered beside its functions.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from supervisor.errors import ApiError, BadRequest
from supervisor.generation.pieces import ToolCall
from supervisor.generation.tools import (
    WEB_SEARCH_TYPES,
    AllowedTools,
    FunctionTool,
    HostedChoice,
    McpTool,
    McpToolFilter,
    NamedFunction,
    ToolChoice,
    offer,
    resolve,
)
from supervisor.knowledge.service import Knowledge
from supervisor.responses.hosted.addresses import checked_server_url, url_problem
from supervisor.responses.hosted.approvals import (
    approved_calls,
    asks,
    check_policy,
    request_item,
)
from supervisor.responses.hosted.availability import available
from supervisor.responses.hosted.code_interpreter import (
    CodeSession,
    Containers,
    code_inputs,
    open_code,
    refuse_code,
)
from supervisor.responses.hosted.file_search import (
    FileSession,
    KnowledgeRef,
    open_files,
)
from supervisor.responses.hosted.mcp_client import McpFailed, McpServer
from supervisor.responses.hosted.settings import HostedSettings
from supervisor.responses.hosted.web_search import WebSession, open_web, refuse_web
from supervisor.responses.items import (
    CodeInterpreterCallItem,
    FileSearchCallItem,
    Item,
    McpApprovalRequestItem,
    McpCallItem,
    McpListToolsItem,
    McpToolInfo,
    WebSearchCallItem,
    new_id,
)
from supervisor.responses.models import ValidRequest


class McpListFailed(ApiError):
    """An MCP server's tools could not be listed (424, as OpenAI answers)."""

    status = 424
    type = "external_connector_error"
    code = "mcp_list_tools_failed"


@dataclass
class ServerTools:
    server: McpServer
    tools: list[McpToolInfo]
    # The listing made for this response (None: reused from the conversation).
    listed: McpListToolsItem | None = None
    # The tools whose calls wait for the user's approval (require_approval).
    asking: frozenset[str] = frozenset()


# The output item of a call the server runs.
HostedCall = McpCallItem | CodeInterpreterCallItem | WebSearchCallItem | FileSearchCallItem


@dataclass
class HostedSession:
    """The hosted tools of one response, and the calls the model made to them."""

    settings: HostedSettings
    servers: dict[str, ServerTools] = field(default_factory=dict)
    # Offered function name -> its server's label.
    owners: dict[str, str] = field(default_factory=dict)
    pending: list[HostedCall] = field(default_factory=list)
    code: CodeSession | None = None
    web: WebSession | None = None
    files: FileSession | None = None
    # Calls the user approved in this request's input: they run first.
    approved: list[McpCallItem] = field(default_factory=list)
    # Whether a generation made an approval request: the response ends after its round.
    asked: bool = False

    def own_tools(self) -> list[CodeSession | WebSession | FileSession]:
        return [tool for tool in (self.code, self.web, self.files) if tool is not None]

    def owns(self, name: str) -> bool:
        return name in self.owners or any(name == tool.name for tool in self.own_tools())

    def call_item(self, call: ToolCall) -> HostedCall | McpApprovalRequestItem:
        """The output item of a call the model made; a complete one waits to
        run, or for the user's approval."""
        item: HostedCall
        if self.code is not None and call.name == self.code.name:
            item = self.code.item(call)
        elif self.web is not None and call.name == self.web.name:
            item = self.web.item(call)
        elif self.files is not None and call.name == self.files.name:
            item = self.files.item(call)
        elif call.complete and call.name in self.servers[self.owners[call.name]].asking:
            self.asked = True
            return request_item(self.owners[call.name], call.name, call.arguments)
        else:
            item = McpCallItem(server_label=self.owners[call.name], name=call.name, arguments=call.arguments,
                               id=new_id("mcp"), status="in_progress" if call.complete else "incomplete")
        if call.complete:
            self.pending.append(item)
        return item

    def take_pending(self) -> list[HostedCall]:
        calls, self.pending = self.pending, []
        return calls

    def functions(self) -> list[FunctionTool]:
        mcp = [FunctionTool(name=t.name, description=t.description, parameters=_parameters(t.input_schema))
               for s in self.servers.values() for t in s.tools]
        return [*mcp, *(tool.function() for tool in self.own_tools())]

    def annotations(self, text: str) -> list[dict[str, Any]]:
        """The citations of an answer's text (the web_search and file_search
        results it cites, the files code wrote that it names), in text order."""
        found = [*(self.web.annotations(text) if self.web is not None else []),
                 *(self.files.annotations(text) if self.files is not None else []),
                 *(self.code.annotations(text) if self.code is not None else [])]
        return sorted(found, key=lambda a: int(a.get("start_index", a.get("index", 0))))

    def listings(self) -> list[McpListToolsItem]:
        return [s.listed for s in self.servers.values() if s.listed is not None]


def _parameters(schema: Any) -> dict[str, Any]:
    return schema if isinstance(schema, dict) else {"type": "object", "properties": {}}


def mcp_tools(valid: ValidRequest) -> list[tuple[int, McpTool]]:
    return [(i, t) for i, t in enumerate(valid.body.tools) if isinstance(t, McpTool)]


def _headers(tool: McpTool) -> dict[str, str]:
    headers = dict(tool.headers or {})
    if tool.authorization:
        headers["Authorization"] = f"Bearer {tool.authorization}"
    return headers


def _allowed(tool: McpTool, tools: list[McpToolInfo]) -> list[McpToolInfo]:
    match tool.allowed_tools:
        case None:
            return tools
        case list() as names:
            return [t for t in tools if t.name in names]
        case McpToolFilter(tool_names=names, read_only=read_only):
            return [t for t in tools if (names is None or t.name in names) and (
                read_only is None or bool((t.annotations or {}).get("readOnlyHint")) == read_only)]
    return tools


def _refuse(tool: McpTool, i: int, settings: HostedSettings) -> None:
    """The 400s that need no network: what this server does not do."""
    name = f"tools[{i}]"
    if not settings.mcp_enabled:
        raise BadRequest(f"mcp tool {name} ({tool.server_label!r}): MCP tools are off on this server "
                         "(an admin enables them by listing server URLs in mcp_allowed_urls)",
                         param=f"{name}.server_url", code="mcp_url_refused")
    if tool.connector_id is not None or tool.tunnel_id is not None:
        raise BadRequest(f"mcp tool {name}: connectors and tunnels are not available here; give a server_url",
                         param=f"{name}.connector_id" if tool.connector_id else f"{name}.tunnel_id")
    if tool.server_url is None:
        raise BadRequest(f"mcp tool {name} needs a server_url", param=f"{name}.server_url")
    check_policy(tool, f"{name}.require_approval")


async def refuse_early(valid: ValidRequest, history: list[Item], settings: HostedSettings,
                       containers: Containers | None = None, owner: str | None = None,
                       knowledge: KnowledgeRef | None = None) -> None:
    """The checks of :func:`open_session` that need no network (a background
    request answers them as a 400 before it is queued): file_search's
    stores are looked up too, in the database, and the approvals answered."""
    approved_calls(history, valid.items, {t.server_label for _, t in mcp_tools(valid)})
    found = knowledge() if knowledge is not None else None
    tools = _available(valid, settings, containers or Containers(), found)
    refuse_code(tools, containers or Containers(), owner)
    await _code_inputs(tools, containers or Containers(), found, owner)
    refuse_web(tools, settings)
    await open_files(tools, [], found, owner)
    for i, tool in mcp_tools(valid):
        _refuse(tool, i, settings)
        problem = url_problem(tool.server_url or "", settings.mcp_allowed_urls)
        if problem is not None:
            raise BadRequest(f"mcp tool tools[{i}]: {problem}", param=f"tools[{i}].server_url",
                             code="mcp_url_refused")


def _available(valid: ValidRequest, settings: HostedSettings, containers: Containers,
               knowledge: Knowledge | None) -> list[Any]:
    """The request's tools less the hosted ones off here that it does not insist on."""
    off = {"code_interpreter": containers.pool is None, "web_search": not settings.web_search_url,
           "file_search": knowledge is None or not knowledge.embedder.model}
    return available(valid.body.tools, valid.body.tool_choice, lambda kind: off[kind])


async def _code_inputs(tools: list[Any], containers: Containers, knowledge: Knowledge | None,
                       owner: str | None) -> list[tuple[str, Path]]:
    """The files the code_interpreter tool copies into its container, checked."""
    if containers.pool is None:
        return []
    return await code_inputs(tools, knowledge.files if knowledge is not None else None, owner,
                             containers.pool.max_upload_bytes)


def _listed_before(items: list[Item], label: str) -> McpListToolsItem | None:
    found = [it for it in items if isinstance(it, McpListToolsItem) and it.server_label == label
             and it.error is None]
    return found[-1] if found else None


async def _list(server: McpServer, index: int) -> list[McpToolInfo]:
    try:
        return await asyncio.wait_for(server.list_tools(), server.timeout_s)
    except TimeoutError as exc:
        raise McpListFailed(f"listing the tools of MCP server {server.label!r} (tools[{index}]) took longer "
                            f"than {server.timeout_s:g} s", param=f"tools[{index}].server_url") from exc
    except McpFailed as exc:
        raise McpListFailed(f"cannot list the tools of MCP server {server.label!r} (tools[{index}]): {exc}",
                            param=f"tools[{index}].server_url") from exc


async def open_session(valid: ValidRequest, history: list[Item], settings: HostedSettings,
                       containers: Containers | None = None, owner: str | None = None,
                       knowledge: KnowledgeRef | None = None) -> tuple[ValidRequest, HostedSession]:
    """The request with its hosted tools offered (its MCP servers' tools, the
    code_interpreter, web and file search), and the session that runs their
    calls. ``owner``: the API key asking (None: the admin), whose vector
    stores file_search may search. Raises BadRequest / McpListFailed."""
    session = HostedSession(settings)
    conversation = [*history, *valid.items]
    found = knowledge() if knowledge else None
    tools = _available(valid, settings, containers or Containers(), found)
    session.code = open_code(tools, conversation, containers or Containers(), owner)
    if session.code is not None:
        session.code.inputs = await _code_inputs(tools, containers or Containers(), found, owner)
        await session.code.recall_written()
    session.web = open_web(tools, conversation, settings)
    session.files = await open_files(tools, conversation, found, owner, valid.caller, list(valid.body.include or []))
    if session.web is not None and session.files is not None:
        # One numbering over both tools' results: a [n] the model writes names one.
        session.web.others.append(session.files.results)
        session.files.others.append(session.web.results)
    entries = mcp_tools(valid)
    labels: set[str] = set()
    for i, tool in entries:
        _refuse(tool, i, settings)
        if tool.server_label in labels:
            raise BadRequest(f"duplicate mcp server_label {tool.server_label!r}", param=f"tools[{i}].server_label")
        labels.add(tool.server_label)
        assert tool.server_url is not None
        await checked_server_url(tool.server_url, settings.mcp_allowed_urls, f"tools[{i}].server_url")
    for i, tool in entries:
        assert tool.server_url is not None
        server = McpServer(tool.server_label, tool.server_url, _headers(tool), settings.mcp_allowed_urls,
                           settings.call_timeout_s)
        before = _listed_before([*history, *valid.items], tool.server_label)
        listed = None
        if before is None:
            # The listing shows what the model is offered: the allowed tools.
            listed = McpListToolsItem(server_label=tool.server_label, tools=_allowed(tool, await _list(server, i)),
                                      id=new_id("mcpl"))
        tools = listed.tools if listed is not None else _allowed(tool, before.tools if before else [])
        session.servers[tool.server_label] = ServerTools(server, tools, listed,
                                                         frozenset(t.name for t in tools if asks(tool, t)))
    session.approved = approved_calls(history, valid.items, set(session.servers))
    return _with_offer(valid, session), session


def _with_offer(valid: ValidRequest, session: HostedSession) -> ValidRequest:
    base = offer(valid.body.tools, "auto")
    taken = {fn.name for fn in base.functions}
    for hosted in session.own_tools():
        if hosted.name in taken:
            raise BadRequest(f"a function is named {hosted.name!r}, as the hosted {hosted.name} tool is offered; "
                             "rename it", param="tools")
    for label, server in session.servers.items():
        for tool in server.tools:
            if tool.name in taken:
                raise BadRequest(f"tool name {tool.name!r} of MCP server {label!r} is offered twice; narrow "
                                 "it away with allowed_tools", param="tools")
            taken.add(tool.name)
            session.owners[tool.name] = label
    offered = resolve([*base.functions, *session.functions()], _choice(valid.body.tool_choice, session),
                      namespaces=base.namespaces)
    return msgspec.structs.replace(valid, offer=offered)


def _allowed_functions(entry: Any, session: HostedSession) -> list[Any]:
    """An ``allowed_tools`` entry in function terms: a hosted tool the
    session runs is its functions (an MCP server's: all, or the one named)."""
    kind = entry.get("type") if isinstance(entry, dict) else None
    name = entry.get("name") if isinstance(entry, dict) else None
    hosted: CodeSession | WebSession | FileSession | None = None
    if kind == "code_interpreter":
        hosted = session.code
    elif kind in WEB_SEARCH_TYPES:
        hosted = session.web
    elif kind == "file_search":
        hosted = session.files
    if hosted is not None:
        return [{"type": "function", "name": hosted.name}]
    if kind == "mcp" and entry.get("server_label") in session.servers:
        names = [t.name for t in session.servers[entry["server_label"]].tools if name is None or t.name == name]
        return [{"type": "function", "name": n} for n in names]
    return [entry]


def _choice(choice: ToolChoice, session: HostedSession) -> ToolChoice:
    """A hosted tool_choice in function terms: code_interpreter's function;
    an ``mcp`` one's tool, else any tool of its server; ``allowed_tools``
    naming hosted tools, their functions."""
    if isinstance(choice, AllowedTools):
        return AllowedTools(mode=choice.mode,
                            tools=[f for entry in choice.tools for f in _allowed_functions(entry, session)])
    if isinstance(choice, HostedChoice) and choice.kind == "code_interpreter" and session.code is not None:
        return NamedFunction(session.code.name)
    if isinstance(choice, HostedChoice) and choice.kind in WEB_SEARCH_TYPES and session.web is not None:
        return NamedFunction(session.web.name)
    if isinstance(choice, HostedChoice) and choice.kind == "file_search" and session.files is not None:
        return NamedFunction(session.files.name)
    if not isinstance(choice, HostedChoice) or choice.kind != "mcp":
        return choice
    label = choice.server_label
    if label not in session.servers:
        raise BadRequest(f"tool_choice names MCP server {label!r}, which is not in tools",
                         param="tool_choice.server_label")
    names = [t.name for t in session.servers[label].tools]
    if choice.name is not None:
        if choice.name not in names:
            raise BadRequest(f"tool_choice names {choice.name!r}, which MCP server {label!r} does not offer",
                             param="tool_choice.name")
        return NamedFunction(choice.name)
    if not names:
        raise BadRequest(f"MCP server {label!r} offers no tools to choose", param="tool_choice.server_label")
    return AllowedTools(mode="required", tools=[{"type": "function", "name": n} for n in names])


def parsed_arguments(call: McpCallItem) -> dict[str, Any] | None:
    try:
        value = json.loads(call.arguments or "{}")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
