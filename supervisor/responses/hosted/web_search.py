"""The ``web_search`` tool of one response: searches and citations.

The model is offered one function, ``web_search(query)``. A call asks the
search provider (:mod:`.searxng`); the results become the
``web_search_call`` item's ``action.sources`` and ``results``, numbered over
the whole conversation, and the model reads them back as ``[n] title, url,
snippet``. Its answer's ``output_text`` gets a ``url_citation`` annotation
for each ``[n]`` it writes that names a result, and for each result URL it
writes out. Off until an admin names a provider (``web_search_searxng_url``);
otherwise a request with the tool is a 400 that says so.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from supervisor.errors import BadRequest
from supervisor.generation.pieces import ToolCall
from supervisor.generation.tools import FunctionTool, WebSearchTool
from supervisor.responses.hosted.searxng import Hit, SearchFailed, provider_problem, search
from supervisor.responses.hosted.settings import HostedSettings
from supervisor.responses.items import Item, SearchAction, SearchResult, SearchSource, WebSearchCallItem, new_id

log = logging.getLogger(__name__)

WEB_FUNCTION = "web_search"
DESCRIPTION = ("Search the web. Returns numbered results: a title, the URL and a snippet each. "
               "Cite a result you use as [n], its number.")
PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"query": {"type": "string", "description": "What to search for."}},
    "required": ["query"],
    "additionalProperties": False,
}
# Results handed to the model per search_context_size (at most the setting).
_CONTEXT_RESULTS = {"low": 3, "medium": 5, "high": 10}
_MARKER = re.compile(r"\[(\d{1,4})\]")


def web_tools(tools: list[Any]) -> list[tuple[int, WebSearchTool]]:
    return [(i, t) for i, t in enumerate(tools) if isinstance(t, WebSearchTool)]


def refuse_web(tools: list[Any], settings: HostedSettings) -> None:
    """The 400s of a request's web_search tool: off here, a cache-only
    search, more than one."""
    for n, (i, tool) in enumerate(web_tools(tools)):
        if not settings.web_search_url:
            raise BadRequest(f"web_search tool tools[{i}]: web search is off on this server (an admin enables it "
                             "by naming a SearXNG endpoint in web_search_searxng_url)", param=f"tools[{i}].type",
                             code="hosted_tool_unavailable")
        problem = provider_problem(settings.web_search_url)
        if problem is not None:
            raise BadRequest(f"web_search tool tools[{i}]: the server's search provider is misconfigured "
                             "(web_search_searxng_url)", param=f"tools[{i}].type", code="hosted_tool_unavailable")
        if n > 0:
            raise BadRequest("only one web_search tool may be given", param=f"tools[{i}]")
        if tool.external_web_access is False:
            raise BadRequest(f"web_search tool tools[{i}]: cache-only search is not available here; leave "
                             "external_web_access out or true", param=f"tools[{i}].external_web_access")


def query_of(arguments: str) -> str | None:
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    query = value.get("query") if isinstance(value, dict) else None
    return query.strip() if isinstance(query, str) and query.strip() else None


def _allowed(url: str, domains: list[str]) -> bool:
    host = (urlsplit(url).hostname or "").lower()
    return any(host == d or host.endswith("." + d) for d in domains)


@dataclass
class WebSession:
    """One response's web_search: the provider, and every result the
    conversation has shown the model, by number."""

    url: str
    timeout_s: float
    max_results: int
    domains: list[str] = field(default_factory=list)
    results: dict[int, SearchResult] = field(default_factory=dict)
    # Calls whose arguments hold no query: they fail without a search.
    unusable: set[str] = field(default_factory=set)
    # Results other tools numbered (file_search's): numbers continue after them.
    others: list[dict[int, Any]] = field(default_factory=list)

    name = WEB_FUNCTION

    def function(self) -> FunctionTool:
        return FunctionTool(name=WEB_FUNCTION, description=DESCRIPTION, parameters=PARAMETERS)

    def item(self, call: ToolCall) -> WebSearchCallItem:
        query = query_of(call.arguments)
        item = WebSearchCallItem(action=SearchAction(query=query if query is not None else call.arguments),
                                 status="in_progress" if call.complete else "incomplete", id=new_id("ws"))
        if query is None:
            self.unusable.add(item.id)
        return item

    async def run(self, item: WebSearchCallItem, limit_s: float) -> None:
        """Search into the item: sources, results, status. Never raises for
        what the provider does; a cancel stops the request."""
        if item.id in self.unusable or not item.action.query:
            log.info("web search call %s: its arguments hold no query", item.id)
            item.status, item.results = "failed", []
            return
        try:
            hits = await asyncio.wait_for(search(self.url, item.action.query, self.timeout_s), limit_s)
        except (SearchFailed, TimeoutError) as exc:
            # The user sees a failed call; the reason (it may name the provider's address) is logged.
            log.warning("web search failed: %s", exc or f"the call took longer than {limit_s:g} s")
            item.status, item.results = "failed", []
            return
        kept = self._numbered([h for h in hits if not self.domains or _allowed(h.url, self.domains)])
        item.results = kept
        item.action.sources = [SearchSource(r.url) for r in kept]
        item.status = "completed"

    def _numbered(self, hits: list[Hit]) -> list[SearchResult]:
        first = max((max(d, default=0) for d in (self.results, *self.others)), default=0) + 1
        kept = [SearchResult(n=first + k, url=h.url, title=h.title, snippet=h.snippet)
                for k, h in enumerate(hits[:self.max_results])]
        self.results.update((r.n, r) for r in kept)
        return kept

    def annotations(self, text: str) -> list[dict[str, Any]]:
        """``url_citation`` annotations of an answer: its ``[n]`` markers that
        name a result, then the result URLs it writes out, in text order."""
        found: list[tuple[int, int, SearchResult]] = []
        for match in _MARKER.finditer(text):
            result = self.results.get(int(match.group(1)))
            if result is not None:
                found.append((match.start(), match.end(), result))
        taken = [(start, end) for start, end, _ in found]
        for result in sorted({r.url: r for r in self.results.values()}.values(), key=lambda r: -len(r.url)):
            for match in re.finditer(re.escape(result.url), text):
                span = (match.start(), match.end())
                if not any(s < span[1] and span[0] < e for s, e in taken):
                    found.append((*span, result))
                    taken.append(span)
        return [{"type": "url_citation", "start_index": start, "end_index": end, "url": r.url,
                 "title": r.title or r.url} for start, end, r in sorted(found, key=lambda f: f[0])]


def open_web(tools: list[Any], items: list[Item], settings: HostedSettings) -> WebSession | None:
    """The response's web_search session (None: no such tool); ``items``:
    the conversation so far, whose results keep their numbers."""
    refuse_web(tools, settings)
    found = web_tools(tools)
    if not found:
        return None
    tool = found[0][1]
    size = tool.search_context_size or "medium"
    domains = [d.strip().lower().removeprefix("www.") for d in (tool.filters.allowed_domains or [])
               if d.strip()] if tool.filters else []
    session = WebSession(settings.web_search_url, settings.web_search_timeout_s,
                         min(settings.web_search_max_results, _CONTEXT_RESULTS[size]), domains)
    for item in items:
        if isinstance(item, WebSearchCallItem):
            session.results.update((r.n, r) for r in item.results or [])
    return session
