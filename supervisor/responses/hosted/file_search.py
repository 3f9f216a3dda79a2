"""The ``file_search`` tool of one response: knowledge-base searches and
file citations.

The model is offered one function, ``file_search(queries)``. A call
searches the vector stores the tool names, in the scope of the API key
that asked (supervisor/knowledge/), with the tool's ``max_num_results``,
``filters`` and ``ranking_options``; the chunks found become the
``file_search_call`` item's results, numbered over the conversation (with
web_search's results, so a number names one result), and the model reads
them back as ``[n] filename, text``. The answer's ``output_text`` gets a
``file_citation`` annotation for each ``[n]`` it writes that names a chunk
and each filename of a result it writes out. Off until an admin names an
embedding model (``file_search_embedding_model``); a store this key cannot
see is a 400 naming ``tools[i].vector_store_ids``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from supervisor.errors import ApiError, BadRequest, NotFound
from supervisor.generation.pieces import ToolCall
from supervisor.generation.tools import FileSearchTool, FunctionTool
from supervisor.knowledge.embedder import SETTING
from supervisor.knowledge.filters import parse as parse_filters
from supervisor.knowledge.records import STORE_PREFIX, checked_id
from supervisor.knowledge.service import MAX_STORES_PER_SEARCH, Knowledge
from supervisor.responses.items import (
    FileSearchCallItem,
    FileSearchResult,
    Item,
    keep_read,
    new_id,
)

log = logging.getLogger(__name__)

FILE_FUNCTION = "file_search"
DESCRIPTION = ("Search the user's files. Returns numbered passages: the file's name and the text each. "
               "Cite a passage you use as [n], its number.")
MAX_QUERIES = 5
# One query as a reader would type it; longer is a runaway generation, cut.
MAX_QUERY_CHARS = 1000
PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"queries": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                               "maxItems": MAX_QUERIES, "description": "What to search for, one or more ways."}},
    "required": ["queries"],
    "additionalProperties": False,
}
DEFAULT_RESULTS = 10
_MARKER = re.compile(r"\[(\d{1,4})\]")

# The knowledge base, once the app has made it (None: not there).
KnowledgeRef = Callable[[], Knowledge | None]


def file_tools(tools: list[Any]) -> list[tuple[int, FileSearchTool]]:
    return [(i, t) for i, t in enumerate(tools) if isinstance(t, FileSearchTool)]


def refuse_files(tools: list[Any], knowledge: Knowledge | None) -> None:
    """The 400s of a request's file_search tool that need no database: off
    here, more than one, a malformed store id, filter or ranking."""
    for n, (i, tool) in enumerate(file_tools(tools)):
        name = f"tools[{i}]"
        if knowledge is None or not knowledge.embedder.model:
            raise BadRequest(f"file_search tool {name}: file search is off on this server (an admin enables it by "
                             f"naming an embedding model in {SETTING})", param=f"{name}.type",
                             code="hosted_tool_unavailable")
        if n > 0:
            raise BadRequest("only one file_search tool may be given", param=name)
        if not 1 <= len(tool.vector_store_ids) <= MAX_STORES_PER_SEARCH:
            raise BadRequest(f"file_search tool {name} names 1 to {MAX_STORES_PER_SEARCH} vector stores",
                             param=f"{name}.vector_store_ids")
        for store_id in tool.vector_store_ids:
            checked_id(store_id, STORE_PREFIX, f"{name}.vector_store_ids")
        if tool.filters is not None:
            parse_filters(tool.filters, f"{name}.filters")
        hybrid = tool.ranking_options.hybrid_search if tool.ranking_options else None
        if hybrid is not None and hybrid.embedding_weight == 0 and hybrid.text_weight == 0:
            raise BadRequest("embedding_weight and text_weight cannot both be 0",
                             param=f"{name}.ranking_options.hybrid_search")


def queries_of(arguments: str) -> list[str] | None:
    """The queries a call asks, bounded; None when it asks none."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    raw = value.get("queries") if isinstance(value, dict) else None
    if isinstance(raw, str):
        raw = [raw]  # one query written as a string: plain enough to take
    if not isinstance(raw, list):
        return None
    queries = [q.strip()[:MAX_QUERY_CHARS] for q in raw if isinstance(q, str) and q.strip()][:MAX_QUERIES]
    return queries or None


def next_number(*numbered: dict[int, Any]) -> int:
    """The number the next result is shown under: after every result any
    search of the conversation has shown."""
    return max((max(d, default=0) for d in numbered), default=0) + 1


@dataclass
class FileSession:
    """One response's file_search: the stores it searches, for whom, how,
    and every chunk the conversation has shown the model, by number."""

    knowledge: Knowledge
    scope: str | None
    store_ids: list[str]
    model: str
    max_results: int
    filters: Any = None
    embedding_weight: float = 1.0
    text_weight: float = 1.0
    score_threshold: float = 0.0
    caller: str = ""
    # Whether the request included file_search_call.results: kept on the item then.
    include_results: bool = False
    results: dict[int, FileSearchResult] = field(default_factory=dict)
    # Results other tools numbered (web_search's): numbers continue after them.
    others: list[dict[int, Any]] = field(default_factory=list)
    unusable: set[str] = field(default_factory=set)

    name = FILE_FUNCTION

    def function(self) -> FunctionTool:
        return FunctionTool(name=FILE_FUNCTION, description=DESCRIPTION, parameters=PARAMETERS)

    def item(self, call: ToolCall) -> FileSearchCallItem:
        queries = queries_of(call.arguments)
        item = FileSearchCallItem(queries=queries or [], status="in_progress" if call.complete else "incomplete",
                                  id=new_id("fs"))
        if queries is None:
            self.unusable.add(item.id)
        return item

    async def run(self, item: FileSearchCallItem, limit_s: float) -> None:
        """Search into the item: results, status. Never raises for what the
        search meets (a store deleted since, the embedding worker down); a
        cancel stops it."""
        if item.id in self.unusable or not item.queries:
            log.info("file search call %s: its arguments hold no query", item.id)
            item.status = "failed"
            return
        try:
            found = await asyncio.wait_for(self._search(item.queries), limit_s)
        except (ApiError, TimeoutError) as exc:
            log.warning("file search failed: %s", getattr(exc, "message", None) or f"over {limit_s:g} s")
            item.status = "failed"
            return
        first = next_number(self.results, *self.others)
        shown = [FileSearchResult(n=first + k, file_id=r.file_id, filename=r.filename, score=r.score, text=r.text,
                                  attributes=dict(r.attributes)) for k, r in enumerate(found)]
        self.results.update((r.n, r) for r in shown)
        keep_read(item, shown)
        if self.include_results:
            item.results = shown
        item.status = "completed"

    async def _search(self, queries: list[str]) -> list[Any]:
        text = await self._fitted("\n".join(queries))
        return await self.knowledge.search(self.scope, self.store_ids, text, self.max_results, self.filters,
                                           embedding_weight=self.embedding_weight, text_weight=self.text_weight,
                                           score_threshold=self.score_threshold, caller=self.caller)

    async def _fitted(self, text: str) -> str:
        """``text`` cut to what the embedding model takes in one input: a
        long query still searches, by its start."""
        embedder = self.knowledge.embedder
        limit = embedder.input_limit()
        while True:
            tokens = await embedder.count(self.model, text)
            if tokens <= limit or len(text) < 2:
                return text
            text = text[:max(1, len(text) * limit * 9 // (tokens * 10))]

    def annotations(self, text: str) -> list[dict[str, Any]]:
        """``file_citation`` annotations of an answer, in text order: its ``[n]`` markers that name a chunk, then the filenames of results
        it writes out (not inside a marker's span)."""
        found: list[tuple[int, int, FileSearchResult]] = []
        for match in _MARKER.finditer(text):
            result = self.results.get(int(match.group(1)))
            if result is not None:
                found.append((match.start(), match.end(), result))
        taken = [(start, end) for start, end, _ in found]
        by_name = {r.filename: r for r in self.results.values() if r.filename}
        for filename in sorted(by_name, key=lambda f: -len(f)):
            for match in re.finditer(re.escape(filename), text):
                span = (match.start(), match.end())
                if not any(s < span[1] and span[0] < e for s, e in taken):
                    found.append((*span, by_name[filename]))
                    taken.append(span)
        return [{"type": "file_citation", "file_id": r.file_id, "filename": r.filename, "index": start}
                for start, _, r in sorted(found, key=lambda f: f[0])]


async def _stores(knowledge: Knowledge, tool: FileSearchTool, i: int, scope: str | None) -> str:
    """The embedding model of the tool's stores, each one ``scope`` may see."""
    param = f"tools[{i}].vector_store_ids"
    models = set()
    for store_id in dict.fromkeys(tool.vector_store_ids):
        try:
            store = await knowledge.book.get(store_id, scope)
        except NotFound as exc:
            raise BadRequest(f"file_search tool tools[{i}]: no vector store with id {store_id!r}",
                             param=param) from exc
        store.check_usable(knowledge.book.clock(), param)
        models.add(store.model)
    if len(models) > 1:
        raise BadRequest(f"file_search tool tools[{i}]: these vector stores were made with different embedding "
                         "models; search them apart", param=param)
    return models.pop()


async def open_files(tools: list[Any], items: list[Item], knowledge: Knowledge | None, scope: str | None,
                     caller: str = "", include: list[str] | None = None) -> FileSession | None:
    """The response's file_search session (None: no such tool); ``items``:
    the conversation so far, whose stored results keep their numbers."""
    refuse_files(tools, knowledge)
    found = file_tools(tools)
    if not found:
        return None
    assert knowledge is not None
    i, tool = found[0]
    model = await _stores(knowledge, tool, i, scope)
    ranking = tool.ranking_options
    hybrid = ranking.hybrid_search if ranking else None
    session = FileSession(knowledge, scope, list(dict.fromkeys(tool.vector_store_ids)), model,
                          tool.max_num_results or DEFAULT_RESULTS, tool.filters,
                          hybrid.embedding_weight if hybrid else 1.0, hybrid.text_weight if hybrid else 1.0,
                          (ranking.score_threshold or 0.0) if ranking else 0.0, caller,
                          "file_search_call.results" in (include or []))
    for item in items:
        if isinstance(item, FileSearchCallItem):
            session.results.update((r.n, r) for r in item.read() or [])
    return session
