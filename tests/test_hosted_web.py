"""The web_search tool end to end: a real gpuvisor server whose search
provider is a stand-in for SearXNG's JSON API on loopback
(tests/searxng_fake.py), and a tiny model forced to call the tool. The
server searches with the query the model wrote, hands the numbered results
back and the model generates again. Items and events validate strictly as
the SDK's types.

The model's weights are random: its query is gibberish in a JSON string,
which it does not always close within the token limit (a call cut short is
never run), so a request is tried up to TRIES times to get one that ran.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai.types.responses import Response, ResponseItem, ResponseStreamEvent
from openai.types.responses.response_function_web_search import ResponseFunctionWebSearch
from pydantic import TypeAdapter

from supervisor.models.demo import write_tiny_gguf
from tests.searxng_fake import RESULTS, FakeSearxng
from tests.server import Server, running, short_tempdir

pytestmark = pytest.mark.timeout(240)
EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
ITEM: TypeAdapter[Any] = TypeAdapter(ResponseItem)
SEARCH = {"type": "web_search"}
HEAD = {"model": "tiny", "max_output_tokens": 1500, "parallel_tool_calls": False}
TRIES = 12
TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeSearxng]:
    server = FakeSearxng().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def srv(fake: FakeSearxng) -> Iterator[Server]:
    models = short_tempdir("gvm")
    write_tiny_gguf(models / "tiny.gguf", n_ctx=8192)
    env = {"GPUVISOR_N_CTX": "8192", "GPUVISOR_WEB_SEARCH_SEARXNG_URL": fake.url,
           "GPUVISOR_WEB_SEARCH_TIMEOUT_S": str(TIMEOUT_S), "GPUVISOR_HOSTED_MAX_ITERATIONS": "2"}
    with running(Server(models, env=env, model="tiny")) as server:
        yield server


@pytest.fixture(autouse=True)
def well_behaved(fake: FakeSearxng) -> Iterator[None]:
    fake.mode = "ok"
    yield
    fake.mode = "ok"


def _create(srv: Server, **body: Any) -> httpx.Response:
    return httpx.post(f"{srv.base_url}/v1/responses", json={**HEAD, **body}, timeout=180)


def _calls(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in output if o["type"] == "web_search_call"]


def _whole(srv: Server, **body: Any) -> dict[str, Any]:
    """A response whose forced call was written whole, so the server ran it."""
    for _ in range(TRIES):
        reply = _create(srv, **{"input": "search", "tools": [SEARCH], "tool_choice": "required", **body})
        assert reply.status_code == 200, reply.text
        made: dict[str, Any] = reply.json()
        if any(c["status"] != "incomplete" for c in _calls(made["output"])):
            return made
    raise AssertionError(f"no forced call was written whole in {TRIES} tries")


def _http_results(allowed: tuple[str, ...] = ()) -> list[str]:
    return [r["url"] for r in RESULTS if not allowed or any(d in r["url"] for d in allowed)]


def test_a_forced_search_runs_the_models_query_and_the_loop_goes_on(srv: Server, fake: FakeSearxng) -> None:
    fake.queries.clear()
    body = _whole(srv)
    Response.model_validate(body, strict=True)
    call = _calls(body["output"])[0]
    checked = ResponseFunctionWebSearch.model_validate(call, strict=True)
    assert checked.status == "completed" and checked.action.type == "search"
    # The provider was asked exactly what the model wrote (up to the query bound).
    assert (checked.action.query or "")[:1000] in fake.queries
    # medium context: the first five http results, in the provider's order, numbered from 1.
    assert [s.url for s in checked.action.sources or []] == _http_results()[:5]
    assert [(r["n"], r["url"]) for r in call["results"]] == list(enumerate(_http_results()[:5], start=1))
    # The model generated again, with the results in its prompt: the second prompt is the first and more.
    cut = _create(srv, input="search", tools=[SEARCH], tool_choice="required", max_output_tokens=1, store=False)
    assert body["usage"]["input_tokens"] > 2 * cut.json()["usage"]["input_tokens"]
    stored = httpx.get(f"{srv.base_url}/v1/responses/{body['id']}", timeout=30).json()
    assert _calls(stored["output"])[0] == call


def test_streamed_events_come_in_order(srv: Server) -> None:
    body = {**HEAD, "input": "search", "tools": [SEARCH], "tool_choice": "required", "stream": True}
    for _ in range(TRIES):
        with httpx.stream("POST", f"{srv.base_url}/v1/responses", json=body, timeout=180) as reply:
            assert reply.status_code == 200
            events = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: ")]
        for event in events:
            EVENT.validate_python(event, strict=True)
        ends = {e["item"]["id"]: e["item"] for e in events
                if e["type"] == "response.output_item.done" and e["item"]["type"] == "web_search_call"}
        for item_id, item in ends.items():
            own = [e["type"] for e in events if e.get("item_id") == item_id or e.get("item", {}).get("id") == item_id]
            ran = {"completed": ["response.web_search_call.searching", "response.web_search_call.completed"],
                   "failed": ["response.web_search_call.searching"], "incomplete": []}[item["status"]]
            assert own == ["response.output_item.added", "response.web_search_call.in_progress", *ran,
                           "response.output_item.done"]
        if any(item["status"] == "completed" for item in ends.values()):
            return
    raise AssertionError(f"no forced call ran in {TRIES} tries")


def test_allowed_domains_keep_only_their_results_and_items_replay(srv: Server) -> None:
    tool = {"type": "web_search_preview", "filters": {"allowed_domains": ["python.org"]},
            "search_context_size": "high"}
    body = _whole(srv, tools=[tool], tool_choice={"type": "web_search_preview"})
    call = _calls(body["output"])[0]
    ResponseFunctionWebSearch.model_validate(call, strict=True)
    assert [s["url"] for s in call["action"]["sources"]] == _http_results(("python.org",))
    # Sent back as input, the call is an input item as the SDK types it, and keeps its results.
    again = _create(srv, input=[{"role": "user", "content": "search"}, call], tools=[SEARCH])
    assert again.status_code == 200, again.text
    items = httpx.get(f"{srv.base_url}/v1/responses/{again.json()['id']}/input_items?order=asc",
                      timeout=30).json()["data"]
    for item in items:
        ITEM.validate_python(item, strict=True)
    assert items[1]["results"] == call["results"]


def test_the_results_reach_the_model(srv: Server) -> None:
    def prompt_tokens(results: list[dict[str, Any]]) -> int:
        call = {"type": "web_search_call", "id": "ws_1", "status": "completed", "results": results,
                "action": {"type": "search", "query": "q", "sources": [{"type": "url", "url": r["url"]}
                                                                       for r in results]}}
        reply = _create(srv, input=[{"role": "user", "content": "go"}, call], max_output_tokens=1, store=False)
        assert reply.status_code == 200, reply.text
        return int(reply.json()["usage"]["input_tokens"])
    many = [{"n": i, "url": f"https://a.example/{i}", "title": "the " * 20, "snippet": "the " * 40}
            for i in range(1, 6)]
    assert prompt_tokens(many) - prompt_tokens(many[:1]) >= 4 * 60


@pytest.mark.parametrize("mode", ["slow", "huge", "redirect", "html"])
def test_a_misbehaving_provider_fails_the_call_not_the_response(srv: Server, fake: FakeSearxng, mode: str) -> None:
    fake.mode, fake.delay_s, fake.followed = mode, 4 * TIMEOUT_S, 0
    started = time.monotonic()
    body = _whole(srv)
    assert time.monotonic() - started < 120
    Response.model_validate(body, strict=True)
    calls = _calls(body["output"])
    ran = [c for c in calls if c["status"] != "incomplete"]
    assert ran and all(c["status"] == "failed" and not c["results"] and not c["action"].get("sources")
                       for c in ran)
    assert body["status"] in ("completed", "incomplete") and fake.followed == 0
    # The loop went on after the failed call (a random model may answer nothing: usage shows the second prompt).
    fake.mode = "ok"
    cut = _create(srv, input="search", tools=[SEARCH], tool_choice="required", max_output_tokens=1, store=False)
    assert body["usage"]["input_tokens"] > 2 * cut.json()["usage"]["input_tokens"]


def test_bad_tools_are_refused_naming_the_field(srv: Server) -> None:
    cached = _create(srv, input="x", tools=[{"type": "web_search", "external_web_access": False}])
    twice = _create(srv, input="x", tools=[SEARCH, {"type": "web_search_preview"}])
    clash = _create(srv, input="x", tools=[SEARCH, {"type": "function", "name": "web_search"}])
    assert [r.status_code for r in (cached, twice, clash)] == [400, 400, 400]
    assert [r.json()["error"]["param"] for r in (cached, twice, clash)] == [
        "tools[0].external_web_access", "tools[1]", "tools"]


def test_off_by_default() -> None:
    models = short_tempdir("gvm")
    write_tiny_gguf(models / "tiny.gguf", n_ctx=1024)
    with running(Server(models, model="tiny")) as server:
        reply = _create(server, input="x", tools=[{"type": "function", "name": "f"}, SEARCH],
                        tool_choice={"type": "web_search"})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "tools[1].type" and "web_search_searxng_url" in error["message"]


async def test_the_agents_sdk_runs_a_turn_with_its_web_search_tool(srv: Server, fake: FakeSearxng) -> None:
    agents = pytest.importorskip("agents", reason="the openai-agents package (test extra) is not installed")
    from openai.types.responses import ResponseFunctionWebSearch as Searched

    from tests.test_clients_sdk import Capture

    capture = Capture()
    client = capture.async_client(srv.base_url)
    model = agents.OpenAIResponsesModel(model=srv.model, openai_client=client)
    settings = agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=1500)
    agent = agents.Agent(name="searcher", instructions="Search first.", tools=[agents.WebSearchTool()],
                         model=model, model_settings=settings)
    config = agents.RunConfig(tracing_disabled=True)
    ran: list[Any] = []
    for _ in range(TRIES):
        # The server ran the searches inside the turn: the agent gets them, and the answer, in one response.
        try:
            result = await agents.Runner.run(agent, "search", run_config=config, max_turns=1)
        except agents.MaxTurnsExceeded:
            continue  # the forced call was cut short: no answer in that turn
        calls = [item.raw_item for item in result.new_items if isinstance(item, agents.ToolCallItem)]
        assert calls and all(isinstance(c, Searched) for c in calls)
        ran = [c for c in calls if c.status == "completed"]
        if ran:
            break
    await client.close()
    assert ran, f"no forced call ran in {TRIES} tries"
    assert ran[0].action.type == "search" and (ran[0].action.query or "")[:1000] in fake.queries
    assert [s.url for s in ran[0].action.sources or []] == _http_results()[:5]
    assert isinstance(result.final_output, str)
    assert capture.validate() > 0
