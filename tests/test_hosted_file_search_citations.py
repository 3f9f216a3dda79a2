"""file_search's citations and queries, without a model: an answer that
cites chunks gets file_citation annotations (events and item as the SDK
types them), numbered with web_search's results, and a call's arguments
become bounded queries."""

from __future__ import annotations

import json
from typing import Any, cast

from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from supervisor.generation.pieces import Text, ToolCall
from supervisor.generation.tools import WebSearchTool
from supervisor.knowledge.service import Knowledge
from supervisor.responses.events import EventBuilder
from supervisor.responses.hosted.file_search import (
    MAX_QUERIES,
    MAX_QUERY_CHARS,
    FileSession,
    next_number,
    queries_of,
)
from supervisor.responses.hosted.searxng import Hit
from supervisor.responses.hosted.session import HostedSession
from supervisor.responses.hosted.settings import HostedSettings
from supervisor.responses.hosted.web_search import open_web
from supervisor.responses.items import (
    FileSearchCallItem,
    FileSearchResult,
    SearchAction,
    SearchResult,
    WebSearchCallItem,
)
from supervisor.responses.models import CreateRequest
from supervisor.responses.objects import Usage, new_response

EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
SETTINGS = HostedSettings(web_search_url="http://127.0.0.1:9/search")
WEB = WebSearchCallItem(action=SearchAction(query="q"), id="ws_1",
                        results=[SearchResult(n=1, url="https://example.com/a", title="A")])
FOUND = [FileSearchResult(n=2, file_id="file-" + "a" * 24, filename="heron.md", score=0.9, text="pebbles"),
         FileSearchResult(n=3, file_id="file-" + "b" * 24, filename="bread.txt", score=0.4, text="bread")]


def _files() -> FileSession:
    # Citations read only the numbered results: no knowledge base is searched here.
    session = FileSession(cast(Knowledge, None), None, ["vs_1"], "m", 10)
    session.results.update((r.n, r) for r in FOUND)
    return session


def _answer(text: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The events and the response of an answer ``text`` after a web search and a file search."""
    web = open_web([WebSearchTool()], [WEB], SETTINGS)
    builder = EventBuilder(new_response(CreateRequest(model="m"), 0.0, "in_progress"))
    builder.hosted = HostedSession(SETTINGS, web=web, files=_files())
    events = [*builder.start(), *builder.pieces([Text(text)]),
              *builder.completed(Usage.of(1, 1, 0, 0), truncated=False)]
    decoded = [json.loads(e.data) for e in events]
    for event in decoded:
        EVENT.validate_python(event, strict=True)
    return decoded, decoded[-1]["response"]


def test_markers_and_filenames_of_chunks_are_cited_beside_web_results() -> None:
    text = "Herons count pebbles [2], says heron.md; the web agrees [1]; [3] too, and [7] is nothing."
    events, response = _answer(text)
    Response.model_validate(response, strict=True)
    annotations = response["output"][0]["content"][0]["annotations"]
    assert [a["type"] for a in annotations] == ["file_citation", "file_citation", "url_citation", "file_citation"]
    files = [a for a in annotations if a["type"] == "file_citation"]
    assert [(a["file_id"], a["filename"]) for a in files] == [
        (FOUND[0].file_id, "heron.md"), (FOUND[0].file_id, "heron.md"), (FOUND[1].file_id, "bread.txt")]
    assert [a["index"] for a in files] == [text.index("[2]"), text.index("heron.md"), text.index("[3]")]
    added = [e for e in events if e["type"] == "response.output_text.annotation.added"]
    assert [e["annotation"] for e in added] == annotations


def test_an_answer_citing_nothing_has_no_annotations() -> None:
    _, response = _answer("Nothing cited [9].")
    assert response["output"][0]["content"][0]["annotations"] == []


def test_new_results_are_numbered_after_both_tools_results() -> None:
    files = _files()
    web = open_web([WebSearchTool()], [WEB], SETTINGS)
    assert web is not None
    web.others.append(files.results)
    files.others.append(web.results)
    # The web's next results come after the file chunks 2 and 3, and the files' after those.
    assert [r.n for r in web._numbered([Hit("https://example.com/b", "B", ""), Hit("https://c.example", "C", "")])
            ] == [4, 5]
    assert next_number(files.results, *files.others) == 6


def test_a_calls_arguments_become_bounded_queries() -> None:
    assert queries_of('{"queries": ["a", " b ", ""]}') == ["a", "b"]
    assert queries_of('{"queries": "one"}') == ["one"]
    assert queries_of('{"queries": ' + json.dumps(["x" * 5000] * 9) + "}") == ["x" * MAX_QUERY_CHARS] * MAX_QUERIES
    assert queries_of('{"queries": []}') is None and queries_of("not json") is None and queries_of("[1]") is None
    session = _files()
    item = session.item(ToolCall("file_search", "nope"))
    assert isinstance(item, FileSearchCallItem) and item.queries == [] and item.id in session.unusable
