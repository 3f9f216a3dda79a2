"""Which functions a request offers the model, and whose calls come back.

A Responses request lists functions, namespaces of functions and hosted tools;
a chat request lists functions only. The model is offered one flat list of
functions: a namespaced one as ``namespace.name`` (templates and grammars
know only flat names, and the dot keeps the grouping readable to the model),
and a call to it comes back split again, with its ``namespace``. Hosted tools
are never offered as such: the ones the server runs (responses/hosted/) are
offered as functions once they are set up, the others never. ``allowed_tools`` narrows the
offered list itself, so the model cannot call, or even see, the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union, cast

import msgspec

from supervisor.errors import BadRequest

ToolName = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]


class FunctionTool(msgspec.Struct, tag="function", tag_field="type", kw_only=True):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamespaceTool(msgspec.Struct, tag="namespace", tag_field="type", kw_only=True):
    """Functions grouped under a name; each is offered to the model as
    ``namespace.name`` and its calls come back with ``namespace`` set."""

    name: ToolName
    description: str = ""
    tools: list[FunctionTool]


class McpToolFilter(msgspec.Struct, kw_only=True):
    tool_names: list[str] | None = None
    read_only: bool | None = None


class McpTool(msgspec.Struct, tag="mcp", tag_field="type", kw_only=True):
    """A remote MCP server whose tools the server itself calls, when an admin
    allows its URL (supervisor/responses/hosted/); never offered as is."""

    server_label: Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    server_url: str | None = None
    connector_id: str | None = None
    tunnel_id: str | None = None
    allowed_tools: list[str] | McpToolFilter | None = None
    headers: dict[str, str] | None = None
    authorization: str | None = None
    require_approval: Literal["always", "never"] | dict[str, Any] | None = None
    server_description: str | None = None
    defer_loading: bool | None = None
    allowed_callers: list[str] | None = None


class CodeInterpreterAuto(msgspec.Struct, tag="auto", tag_field="type", kw_only=True):
    """``container: {"type": "auto"}``: a container made for the calls (or
    the one an earlier call of the conversation used, while it lives)."""

    file_ids: list[str] | None = None
    memory_limit: Literal["1g", "4g", "16g", "64g"] | None = None
    # {"type": "disabled"} is what the sandbox has anyway; an allowlist is refused.
    network_policy: dict[str, Any] | None = None


class CodeInterpreterTool(msgspec.Struct, tag="code_interpreter", tag_field="type", kw_only=True):
    """Python the server runs in a sandbox, when an admin enables it
    (supervisor/responses/hosted/, supervisor/sandbox/); never offered as is.
    ``container``: a container id (``cntr_...``) or ``{"type": "auto"}``."""

    container: str | CodeInterpreterAuto


class WebSearchFilters(msgspec.Struct, kw_only=True):
    allowed_domains: list[str] | None = None


class WebSearchTool(msgspec.Struct, kw_only=True):
    """Web search the server runs through its search provider, when an admin
    sets one (supervisor/responses/hosted/web_search.py); never offered as
    is. One Struct per type the SDK names (``web_search``, ``..._preview``...)."""

    filters: WebSearchFilters | None = None
    search_context_size: Literal["low", "medium", "high"] | None = None
    # A hint OpenAI localizes results with; the provider here is not told.
    user_location: dict[str, Any] | None = None
    # False asks for cached pages only, which the provider cannot promise: a 400.
    external_web_access: bool | None = None
    search_content_types: list[str] | None = None


class FileSearchHybrid(msgspec.Struct, kw_only=True):
    embedding_weight: Annotated[float, msgspec.Meta(ge=0.0, le=1e6)]
    text_weight: Annotated[float, msgspec.Meta(ge=0.0, le=1e6)]


class FileSearchRanking(msgspec.Struct, kw_only=True):
    # One ranker here (the knowledge base's hybrid fusion): the names are accepted.
    ranker: Literal["none", "auto", "default-2024-11-15"] | None = None
    score_threshold: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    hybrid_search: FileSearchHybrid | None = None


class FileSearchTool(msgspec.Struct, tag="file_search", tag_field="type", kw_only=True):
    """A search of the caller's vector stores the server runs, when an admin
    names an embedding model (supervisor/responses/hosted/file_search.py);
    never offered as is. ``filters``: OpenAI's attribute filters, checked
    by the knowledge base."""

    vector_store_ids: list[str]
    max_num_results: Annotated[int, msgspec.Meta(ge=1, le=50)] | None = None
    filters: Any = None
    ranking_options: FileSearchRanking | None = None


WEB_SEARCH_TYPES = ("web_search", "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11")
_WEB_SEARCH_STRUCTS = tuple(
    cast(type[WebSearchTool], msgspec.defstruct("Tool" + "".join(p.capitalize() for p in t.split("_")), [],
                                                bases=(WebSearchTool,), tag=t, tag_field="type"))
    for t in WEB_SEARCH_TYPES)


class HostedTool(msgspec.Struct):
    """A tool OpenAI runs on its side (search, code, images, MCP, shells...).

    Nothing runs it here: it is accepted, so clients that always send one
    work, but never offered to the model nor echoed in the response's
    ``tools`` (the tools the model may call)."""


# Every hosted type of the official SDK's ``Tool`` union.
HOSTED_TOOL_TYPES = (
    "web_search", "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11",
    "file_search", "code_interpreter", "image_generation", "computer", "computer_use_preview",
    "mcp", "local_shell", "shell", "apply_patch", "tool_search", "programmatic_tool_calling",
)


def _hosted_struct(tool_type: str) -> type[HostedTool]:
    name = "Hosted" + "".join(part.capitalize() for part in tool_type.split("_"))
    return cast(type[HostedTool], msgspec.defstruct(name, [], bases=(HostedTool,), tag=tool_type, tag_field="type"))


# The hosted tools the server can run (responses/hosted/) have their own Structs.
RUN_HERE = ("mcp", "code_interpreter", "file_search", *WEB_SEARCH_TYPES)
_HOSTED_STRUCTS = tuple(_hosted_struct(t) for t in HOSTED_TOOL_TYPES if t not in RUN_HERE)

if TYPE_CHECKING:
    RequestTool = (FunctionTool | NamespaceTool | McpTool | CodeInterpreterTool | WebSearchTool | FileSearchTool
                   | HostedTool)
else:
    RequestTool = Union[(FunctionTool, NamespaceTool, McpTool, CodeInterpreterTool, FileSearchTool,
                         *_WEB_SEARCH_STRUCTS, *_HOSTED_STRUCTS)]


def runs_here(tool: RequestTool) -> bool:
    """A hosted tool the server runs itself (its calls and choice are resolved
    once the tool is set up, in responses/hosted/)."""
    return isinstance(tool, McpTool | CodeInterpreterTool | WebSearchTool | FileSearchTool)


class NamedFunction(msgspec.Struct, tag="function", tag_field="type"):
    name: str


class AllowedTools(msgspec.Struct, tag="allowed_tools", tag_field="type", kw_only=True):
    """Only these tools may be called; the model is offered no other."""

    mode: Literal["auto", "required"]
    tools: list[dict[str, Any]]


class HostedChoice(msgspec.Struct, omit_defaults=True, kw_only=True):
    """A tool_choice naming a hosted tool (``{"type": "mcp", "server_label": ...}``,
    ``{"type": "web_search"}``): those of RUN_HERE run here (responses/hosted/)."""

    server_label: str | None = None
    name: str | None = None

    @property
    def kind(self) -> str:
        return str(self.__struct_config__.tag)


_HOSTED_CHOICES = tuple(
    cast(type[HostedChoice], msgspec.defstruct("Choice" + "".join(p.capitalize() for p in t.split("_")), [],
                                               bases=(HostedChoice,), tag=t, tag_field="type"))
    for t in HOSTED_TOOL_TYPES)

if TYPE_CHECKING:
    ToolChoice = Literal["none", "auto", "required"] | NamedFunction | AllowedTools | HostedChoice
else:
    ToolChoice = Union[(Literal["none", "auto", "required"], NamedFunction, AllowedTools, *_HOSTED_CHOICES)]
# What the planner takes, once allowed_tools has narrowed the offered tools.
PlanChoice = Literal["none", "auto", "required"] | NamedFunction

_HOSTED = frozenset(HOSTED_TOOL_TYPES)


def qualified(namespace: str, name: str) -> str:
    return f"{namespace}.{name}"


@dataclass(frozen=True)
class Offer:
    """The functions the model is offered, how it must call them, and the
    namespace behind each qualified name."""

    functions: list[FunctionTool] = field(default_factory=list)
    choice: PlanChoice = "auto"
    namespaces: dict[str, tuple[str, str]] = field(default_factory=dict)

    def split(self, name: str) -> tuple[str | None, str]:
        """A called name as ``(namespace, name)``; namespace None for a plain function."""
        return self.namespaces.get(name, (None, name))


def _flatten(tools: list[RequestTool]) -> tuple[list[FunctionTool], dict[str, tuple[str, str]]]:
    functions: list[FunctionTool] = []
    namespaces: dict[str, tuple[str, str]] = {}
    seen: set[str] = set()

    def add(fn: FunctionTool, param: str) -> None:
        if fn.name in seen:
            raise BadRequest(f"duplicate tool name {fn.name!r}", param=param)
        seen.add(fn.name)
        functions.append(fn)

    for i, tool in enumerate(tools):
        if isinstance(tool, FunctionTool):
            add(tool, f"tools[{i}].name")
        elif isinstance(tool, NamespaceTool):
            for j, fn in enumerate(tool.tools):
                name = qualified(tool.name, fn.name)
                add(msgspec.structs.replace(fn, name=name), f"tools[{i}].tools[{j}].name")
                namespaces[name] = (tool.name, fn.name)
    return functions, namespaces


def _resolve_name(functions: list[FunctionTool], namespaces: dict[str, tuple[str, str]], name: str,
                  namespace: str | None = None) -> str | None:
    """The offered name a choice means: exact, qualified, or a namespaced function's own unique name."""
    names = {fn.name for fn in functions}
    wanted = qualified(namespace, name) if namespace else name
    if wanted in names:
        return wanted
    if namespace:
        return None
    short = [q for q, (_, own) in namespaces.items() if own == name and q in names]
    return short[0] if len(short) == 1 else None


def _allowed_names(entry: Any, functions: list[FunctionTool], namespaces: dict[str, tuple[str, str]],
                   param: str) -> set[str]:
    kind = entry.get("type") if isinstance(entry, dict) else None
    if kind in _HOSTED:
        return set()  # allowed, but never offered: nothing here runs it
    name = entry.get("name") if isinstance(entry, dict) else None
    if kind == "namespace" and isinstance(name, str):
        found = {q for q, (ns, _) in namespaces.items() if ns == name}
        if not found:
            raise BadRequest(f"allowed tool namespace {name!r} is not in tools", param=f"{param}.name")
        return found
    if kind != "function":
        raise BadRequest(f"allowed tools are functions, namespaces or hosted tools, not {kind!r}",
                         param=f"{param}.type")
    ns = entry.get("namespace")
    resolved = _resolve_name(functions, namespaces, name, ns if isinstance(ns, str) else None) \
        if isinstance(name, str) else None
    if resolved is None:
        raise BadRequest(f"allowed tool {name!r} is not in tools", param=f"{param}.name")
    return {resolved}


def _narrow(functions: list[FunctionTool], namespaces: dict[str, tuple[str, str]], choice: AllowedTools,
            param: str) -> Offer:
    allowed: set[str] = set()
    for k, entry in enumerate(choice.tools):
        allowed |= _allowed_names(entry, functions, namespaces, f"{param}.tools[{k}]")
    offered = [fn for fn in functions if fn.name in allowed]
    if choice.mode == "required" and not offered:
        raise BadRequest("allowed_tools mode 'required' needs at least one allowed function", param=param)
    return Offer(offered, choice.mode, namespaces)


def resolve(functions: list[FunctionTool], choice: ToolChoice, *,
            namespaces: dict[str, tuple[str, str]] | None = None, param: str = "tool_choice") -> Offer:
    """What ``choice`` offers among ``functions``; ``param`` names the choice in errors."""
    namespaces = namespaces or {}
    if isinstance(choice, HostedChoice):
        if choice.kind == "mcp":
            raise BadRequest("tool_choice names an MCP server, but tools has no mcp tool", param=param)
        if choice.kind in RUN_HERE:
            raise BadRequest(f"tool_choice names the {choice.kind} tool, but tools has none", param=f"{param}.type")
        raise BadRequest(f"tool_choice {choice.kind!r}: the hosted {choice.kind} tool is not enabled on this "
                         "server (of the hosted tools, only mcp, code_interpreter, web_search and file_search "
                         "run here)",
                         param=f"{param}.type", code="hosted_tool_unavailable")
    if isinstance(choice, AllowedTools):
        return _narrow(functions, namespaces, choice, param)
    if isinstance(choice, NamedFunction):
        name = _resolve_name(functions, namespaces, choice.name)
        if name is None:
            raise BadRequest(f"tool_choice names {choice.name!r}, which is not in tools", param=f"{param}.name")
        return Offer(functions, NamedFunction(name), namespaces)
    if choice == "required" and not functions:
        raise BadRequest("tool_choice 'required' needs at least one tool", param=param)
    return Offer(functions, choice, namespaces)


def offer(tools: list[RequestTool], choice: ToolChoice) -> Offer:
    """The offer of a Responses request's ``tools`` under ``tool_choice``."""
    functions, namespaces = _flatten(tools)
    return resolve(functions, choice, namespaces=namespaces)


def echoed(tools: list[RequestTool]) -> list[FunctionTool | NamespaceTool]:
    """The tools a response lists: the ones the model may call (hosted ones are not)."""
    return [t for t in tools if isinstance(t, FunctionTool | NamespaceTool)]
