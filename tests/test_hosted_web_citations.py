"""web_search's citations and provider rules, without a model: an answer
that cites results gets url_citation annotations (events and item as the
SDK types them), and the provider's address obeys the MCP rules."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from supervisor.generation.pieces import Text, ToolCall
from supervisor.generation.tools import WebSearchTool
from supervisor.responses.events import EventBuilder
from supervisor.responses.hosted.searxng import SearchFailed, provider_problem, search
from supervisor.responses.hosted.session import HostedSession
from supervisor.responses.hosted.settings import HostedSettings
from supervisor.responses.hosted.web_search import open_web
from supervisor.responses.items import SearchAction, SearchResult, WebSearchCallItem
from supervisor.responses.models import CreateRequest
from supervisor.responses.objects import Usage, new_response
from tests.searxng_fake import FakeSearxng

EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
SETTINGS = HostedSettings(web_search_url="http://127.0.0.1:9/search")
EARLIER = WebSearchCallItem(action=SearchAction(query="python json"), id="ws_1", results=[
    SearchResult(n=1, url="https://docs.python.org/3/library/json.html", title="json"),
    SearchResult(n=2, url="https://example.com/a", title="")])


def _answer(text: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The events and the response of an answer ``text`` in a conversation holding EARLIER."""
    web = open_web([WebSearchTool()], [EARLIER], SETTINGS)
    builder = EventBuilder(new_response(CreateRequest(model="m"), 0.0, "in_progress"))
    builder.hosted = HostedSession(SETTINGS, web=web)
    events = [*builder.start(), *builder.pieces([Text(text)]),
              *builder.completed(Usage.of(1, 1, 0, 0), truncated=False)]
    decoded = [json.loads(e.data) for e in events]
    for event in decoded:
        EVENT.validate_python(event, strict=True)
    return decoded, decoded[-1]["response"]


def test_markers_and_urls_of_results_are_cited() -> None:
    text = "JSON is in the stdlib [1], see https://example.com/a and [3] [2]."
    events, response = _answer(text)
    Response.model_validate(response, strict=True)
    annotations = response["output"][0]["content"][0]["annotations"]
    spans = [(a["start_index"], a["end_index"], a["url"]) for a in annotations]
    assert [text[s:e] for s, e, _ in spans] == ["[1]", "https://example.com/a", "[2]"]  # [3] names no result
    assert [u for _, _, u in spans] == [EARLIER.results[0].url, EARLIER.results[1].url,  # type: ignore[index]
                                        EARLIER.results[1].url]  # type: ignore[index]
    assert annotations[1]["title"] == "https://example.com/a"  # no title: the URL stands in
    added = [e for e in events if e["type"] == "response.output_text.annotation.added"]
    assert [e["annotation"] for e in added] == annotations
    assert [e["annotation_index"] for e in added] == [0, 1, 2]
    kinds = [e["type"] for e in events]
    assert kinds.index("response.output_text.annotation.added") < kinds.index("response.output_text.done")


def test_an_answer_citing_nothing_has_no_annotations() -> None:
    events, response = _answer("No sources here [9].")
    assert response["output"][0]["content"][0]["annotations"] == []
    assert not [e for e in events if e["type"] == "response.output_text.annotation.added"]


def test_new_results_are_numbered_after_the_conversations() -> None:
    fake = FakeSearxng().start()
    try:
        web = open_web([WebSearchTool()], [EARLIER], HostedSettings(web_search_url=fake.url))
        assert web is not None
        item = web.item(ToolCall("web_search", '{"query": "more"}'))
        asyncio.run(web.run(item, 10.0))
    finally:
        fake.stop()
    assert item.status == "completed" and fake.queries == ["more"]
    assert [r.n for r in item.results or []] == [3, 4, 5, 6, 7]


@pytest.mark.parametrize("url,why", [
    ("http://169.254.169.254/latest/meta-data", "link-local"),
    ("http://[fe80::1]:8080/search", "link-local"),
    ("http://user:pw@127.0.0.1/search", "credentials"),
    ("file:///etc/passwd", "http or https"),
])
async def test_the_provider_obeys_the_address_rules(url: str, why: str) -> None:
    with pytest.raises(SearchFailed) as failed:
        await search(url, "q", 5.0)
    assert why in str(failed.value)


def test_a_bad_provider_url_is_named() -> None:
    assert provider_problem("http://127.0.0.1:8888/search") is None
    assert provider_problem("http://127.0.0.1:99999/search") is not None
