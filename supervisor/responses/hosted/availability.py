"""Hosted tools this server has off, left out of a request that does not
insist on them.

Agent clients send hosted tools with every request whatever the server
runs (the Codex CLI sends ``web_search`` in each turn): a 400 for a tool
the admin left off would stop them dead, so such a tool is not offered to
the model, as a model without it would not be, and the request is served.
A request that insists on the tool (a ``tool_choice`` naming its type,
directly or in ``allowed_tools``) still gets the 400 that says why it is
off and which setting turns it on. ``GET /api/hosted-tools`` says which
tools are on. MCP tools are not dropped: a server URL is the client's
explicit ask, and the allowlist's refusal names it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from supervisor.generation.tools import AllowedTools, CodeInterpreterTool, FileSearchTool, HostedChoice, WebSearchTool

log = logging.getLogger("gpuvisor.responses")


def _kind(tool: Any) -> str | None:
    if isinstance(tool, CodeInterpreterTool):
        return "code_interpreter"
    if isinstance(tool, WebSearchTool):
        return "web_search"
    if isinstance(tool, FileSearchTool):
        return "file_search"
    return None


def insisted(choice: Any) -> set[str]:
    """The hosted tool kinds ``choice`` names (the web_search variants as one)."""
    if isinstance(choice, HostedChoice):
        return {"web_search" if choice.kind.startswith("web_search") else choice.kind}
    if isinstance(choice, AllowedTools):
        kinds = {str(entry.get("type", "")) for entry in choice.tools}
        return {"web_search" if k.startswith("web_search") else k for k in kinds}
    return set()


def available(tools: list[Any], choice: Any, off: Callable[[str], bool]) -> list[Any]:
    """``tools`` with each hosted tool that is ``off`` here and not insisted
    on replaced by None, so that the others keep their index (errors name
    ``tools[i]``) and nothing offers the dropped one."""
    named = insisted(choice)
    out: list[Any] = []
    for i, tool in enumerate(tools):
        kind = _kind(tool)
        if kind is not None and kind not in named and off(kind):
            log.info("tools[%d] (%s) is not offered: it is off on this server (see /api/hosted-tools)", i, kind)
            out.append(None)
        else:
            out.append(tool)
    return out
