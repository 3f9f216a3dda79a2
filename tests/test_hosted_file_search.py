"""The file_search tool end to end: a real gpuvisor server whose knowledge
base embeds with the tiny model, a vector store made through the API, and
the tiny model forced to call the tool. The server searches the caller's
stores with the queries the model wrote, hands the chunks back and the
model generates again. Items and events validate strictly as the SDK's
types.

The model's weights are random: its queries are gibberish, which it does
not always close within the token limit (a call cut short is never run),
so a request is tried several times, or with several inputs at
temperature 0, to get one that ran.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai.types.responses import Response, ResponseFileSearchToolCall, ResponseItem, ResponseStreamEvent
from pydantic import TypeAdapter

from supervisor.models.demo import write_tiny_gguf
from tests.server import REPO, Server, poll_until, running, short_tempdir

pytestmark = pytest.mark.timeout(300)
EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
ITEM: TypeAdapter[Any] = TypeAdapter(ResponseItem)
HEAD = {"model": "tiny", "max_output_tokens": 1000, "parallel_tool_calls": False}
EMBED = {"GPUVISOR_FILE_SEARCH_EMBEDDING_MODEL": "tiny"}
ADMIN = "gva_0123abcd_" + "C" * 43
TRIES = 12
# A passage of a few hundred tokens (one chunk), and a short one.
LONG_TEXT = " ".join(f"The heron counts {i} silver pebbles beside the quiet mill pond." for i in range(24))
SHORT_TEXT = "Bread rises."


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    models = short_tempdir("gvm")
    write_tiny_gguf(models / "tiny.gguf", n_ctx=8192)
    # One round of calls, then the answer: a response's prompts are the first and the one with the results.
    env = {"GPUVISOR_N_CTX": "8192", "GPUVISOR_HOSTED_MAX_ITERATIONS": "1", **EMBED}
    with running(Server(models, env=env, model="tiny")) as server:
        yield server


def _store(srv: Server, filename: str, text: str, key: str | None = None) -> tuple[str, str]:
    """A vector store holding one file, indexed: (store id, file id)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    up = httpx.post(f"{srv.base_url}/v1/files", files={"file": (filename, text.encode())},
                    data={"purpose": "assistants"}, headers=headers, timeout=60)
    assert up.status_code == 200, up.text
    made = httpx.post(f"{srv.base_url}/v1/vector_stores", json={"name": filename, "file_ids": [up.json()["id"]]},
                      headers=headers, timeout=60)
    assert made.status_code == 200, made.text
    store_id = made.json()["id"]
    poll_until(lambda: httpx.get(f"{srv.base_url}/v1/vector_stores/{store_id}", headers=headers, timeout=30).json(),
               lambda s: s["file_counts"]["completed"] == 1, timeout=120)
    return store_id, up.json()["id"]


@pytest.fixture(scope="module")
def stores(srv: Server) -> dict[str, tuple[str, str]]:
    return {"long": _store(srv, "heron.md", LONG_TEXT), "short": _store(srv, "bread.txt", SHORT_TEXT)}


def _tool(store_id: str, **extra: Any) -> dict[str, Any]:
    return {"type": "file_search", "vector_store_ids": [store_id], **extra}


def _create(srv: Server, key: str | None = None, **body: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{srv.base_url}/v1/responses", json={**HEAD, **body}, headers=headers, timeout=240)


def _calls(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in output if o["type"] == "file_search_call"]


def _ran(body: dict[str, Any]) -> bool:
    return any(c["status"] != "incomplete" for c in _calls(body["output"]))


def _forced(srv: Server, store_id: str, **body: Any) -> dict[str, Any]:
    """A response (temperature 0) whose forced call was written whole, so the
    server ran it; its input is kept in ``_input`` to run it again."""
    for n in range(TRIES):
        ask = f"look it up {n}"
        reply = _create(srv, input=ask, tools=[_tool(store_id)], tool_choice="required", temperature=0, **body)
        assert reply.status_code == 200, reply.text
        made: dict[str, Any] = reply.json()
        if _ran(made):
            return {**made, "_input": ask}
    raise AssertionError(f"no forced call was written whole in {TRIES} tries")


def test_a_forced_search_finds_the_chunk_and_the_model_reads_it(
        srv: Server, stores: dict[str, tuple[str, str]]) -> None:
    long_store, long_file = stores["long"]
    body = _forced(srv, long_store, include=["file_search_call.results"])
    ask = body.pop("_input")
    Response.model_validate(body, strict=True)
    call = _calls(body["output"])[0]
    checked = ResponseFileSearchToolCall.model_validate(call, strict=True)
    assert checked.status == "completed" and checked.queries and all(checked.queries)
    # The only file of the store, whatever the gibberish asked: its chunks, named and scored.
    found = checked.results or []
    assert found and {(r.file_id, r.filename) for r in found} == {(long_file, "heron.md")}
    assert all(r.text and r.text in LONG_TEXT and r.score is not None and 0 < r.score <= 1 for r in found)
    assert body["output"][-1]["type"] == "message"  # one round, then the answer

    # The same call over the short file's store: the same first prompt and
    # call (temperature 0); the second prompt differs by the chunk it read.
    short = _create(srv, input=ask, tools=[_tool(stores["short"][0])], tool_choice="required", temperature=0,
                    include=["file_search_call.results"]).json()
    [short_call] = _calls(short["output"])
    assert short_call["queries"] == call["queries"] and short_call["results"][0]["text"] == SHORT_TEXT
    grown = body["usage"]["input_tokens"] - short["usage"]["input_tokens"]
    assert grown >= len(LONG_TEXT) // 8, grown  # the chunk reached the model

    # Without include the item keeps no results, yet the model read the same chunk.
    hidden = _create(srv, input=ask, tools=[_tool(long_store)], tool_choice="required", temperature=0).json()
    Response.model_validate(hidden, strict=True)
    [hidden_call] = _calls(hidden["output"])
    assert hidden_call["status"] == "completed" and hidden_call["results"] is None
    assert hidden["usage"]["input_tokens"] == body["usage"]["input_tokens"]

    # Stored and replayed: GET shows the call; a follow-up rereads the kept chunk.
    stored = httpx.get(f"{srv.base_url}/v1/responses/{body['id']}", timeout=30).json()
    assert _calls(stored["output"])[0] == call
    follow = [_create(srv, previous_response_id=r["id"], input="thanks", tools=[_tool(long_store)],
                      max_output_tokens=1).json() for r in (body, hidden)]
    assert follow[0]["usage"]["input_tokens"] - follow[1]["usage"]["input_tokens"] >= len(LONG_TEXT) // 8


def test_streamed_events_come_in_order(srv: Server, stores: dict[str, tuple[str, str]]) -> None:
    request = {**HEAD, "input": "find", "tools": [_tool(stores["short"][0], max_num_results=3)],
               "tool_choice": {"type": "file_search"}, "stream": True}
    for _ in range(TRIES):
        with httpx.stream("POST", f"{srv.base_url}/v1/responses", json=request, timeout=240) as reply:
            assert reply.status_code == 200
            events = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: ")]
        for event in events:
            EVENT.validate_python(event, strict=True)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        ends = {e["item"]["id"]: e["item"] for e in events
                if e["type"] == "response.output_item.done" and e["item"]["type"] == "file_search_call"}
        for item_id, item in ends.items():
            own = [e["type"] for e in events if e.get("item_id") == item_id or e.get("item", {}).get("id") == item_id]
            ran = {"completed": ["response.file_search_call.searching", "response.file_search_call.completed"],
                   "failed": ["response.file_search_call.searching"], "incomplete": []}[item["status"]]
            assert own == ["response.output_item.added", "response.file_search_call.in_progress", *ran,
                           "response.output_item.done"]
        if any(item["status"] == "completed" for item in ends.values()):
            assert events[-1]["type"] in ("response.completed", "response.incomplete")
            final = events[-1]["response"]
            Response.model_validate(final, strict=True)
            assert [c["status"] for c in _calls(final["output"])] == [i["status"] for i in ends.values()]
            return
    raise AssertionError(f"no forced call ran in {TRIES} tries")


def test_a_call_sent_back_as_input_replays(srv: Server, stores: dict[str, tuple[str, str]]) -> None:
    store_id, file_id = stores["short"]
    call = {"type": "file_search_call", "id": "fs_1", "status": "completed", "queries": ["bread"],
            "results": [{"n": 1, "file_id": file_id, "filename": "bread.txt", "score": 0.5, "text": SHORT_TEXT,
                         "attributes": {}}]}
    again = _create(srv, input=[{"role": "user", "content": "go"}, call], tools=[_tool(store_id)],
                    max_output_tokens=1)
    assert again.status_code == 200, again.text
    items = httpx.get(f"{srv.base_url}/v1/responses/{again.json()['id']}/input_items?order=asc",
                      timeout=30).json()["data"]
    for item in items:
        ITEM.validate_python(item, strict=True)
    assert items[1]["results"] == call["results"]


def test_bad_tools_are_refused_naming_the_field(srv: Server, stores: dict[str, tuple[str, str]]) -> None:
    store_id = stores["short"][0]
    cases = {
        "tools[1].vector_store_ids": [{"type": "function", "name": "f"}, _tool("vs_" + "0" * 24)],
        "tools[0].vector_store_ids": [_tool("vs_../../etc")],
        "tools[1]": [_tool(store_id), _tool(store_id)],
        "tools[0].filters.key": [_tool(store_id, filters={"type": "eq", "key": 5, "value": "x"})],
        "tools[0].ranking_options.hybrid_search": [_tool(store_id, ranking_options={
            "hybrid_search": {"embedding_weight": 0, "text_weight": 0}})],
        "tools": [_tool(store_id), {"type": "function", "name": "file_search"}],
    }
    for param, tools in cases.items():
        # A background request is refused before it is queued (a name clash shows once it runs).
        for background in (False, True) if param != "tools" else (False,):
            reply = _create(srv, input="x", tools=tools, background=background)
            assert reply.status_code == 400, (param, reply.text)
            assert reply.json()["error"]["param"] == param, reply.text
    too_many = _create(srv, input="x", tools=[_tool(store_id, max_num_results=51)])
    assert too_many.status_code == 400 and "max_num_results" in too_many.json()["error"]["param"]


def _add_key(state: Path, name: str) -> str:
    out = subprocess.run([sys.executable, "-m", "supervisor", "keys", "add", name, "--state-dir", str(state)],
                         capture_output=True, text=True, cwd=REPO, timeout=60, check=True)
    return out.stdout.strip()


def test_a_key_searches_only_its_own_stores() -> None:
    models = short_tempdir("gvm")
    write_tiny_gguf(models / "tiny.gguf", n_ctx=4096)
    state = short_tempdir("gv")
    alice, bob = _add_key(state, "alice"), _add_key(state, "bob")
    env = {"GPUVISOR_N_CTX": "4096", "GPUVISOR_ADMIN_TOKEN": ADMIN, **EMBED}
    with running(Server(models, state_dir=state, env=env, model="tiny")) as srv:
        secret, _ = _store(srv, "secret.md", "Alice keeps the garnet ledger.", key=alice)
        own, own_file = _store(srv, "notes.md", "Bob waters the fern.", key=bob)
        for tools in ([_tool(secret)], [{"type": "function", "name": "f"}, _tool(secret)],
                      [{"type": "file_search", "vector_store_ids": [own, secret]}]):
            reply = _create(srv, key=bob, input="x", tools=tools, max_output_tokens=1)
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["param"] == f"tools[{len(tools) - 1}].vector_store_ids" and secret in error["message"]
        # Alice and the admin may search alice's store; bob's own search finds bob's file only.
        for key in (alice, ADMIN):
            assert _create(srv, key=key, input="x", tools=[_tool(secret)], max_output_tokens=1).status_code == 200
        for _ in range(TRIES):
            body = _create(srv, key=bob, input="find", tools=[_tool(own)], tool_choice="required",
                           include=["file_search_call.results"]).json()
            ran = [c for c in _calls(body["output"]) if c["status"] == "completed"]
            if ran:
                assert {r["file_id"] for c in ran for r in c["results"]} == {own_file}
                return
        raise AssertionError(f"no forced call ran in {TRIES} tries")


def test_off_without_an_embedding_model() -> None:
    models = short_tempdir("gvm")
    write_tiny_gguf(models / "tiny.gguf", n_ctx=1024)
    with running(Server(models, model="tiny")) as server:
        reply = _create(server, input="x", tools=[{"type": "function", "name": "f"}, _tool("vs_" + "0" * 24)],
                        tool_choice={"type": "file_search"})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "tools[1].type" and "file_search_embedding_model" in error["message"]


async def test_the_agents_sdk_runs_a_turn_with_its_file_search_tool(
        srv: Server, stores: dict[str, tuple[str, str]]) -> None:
    agents = pytest.importorskip("agents", reason="the openai-agents package (test extra) is not installed")
    from openai.types.responses import ResponseFileSearchToolCall as Searched

    from tests.test_clients_sdk import Capture

    store_id, file_id = stores["short"]
    capture = Capture()
    client = capture.async_client(srv.base_url)
    model = agents.OpenAIResponsesModel(model=srv.model, openai_client=client)
    settings = agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=1000)
    tool = agents.FileSearchTool(vector_store_ids=[store_id], max_num_results=3, include_search_results=True)
    agent = agents.Agent(name="reader", instructions="Search the files first.", tools=[tool], model=model,
                         model_settings=settings)
    config = agents.RunConfig(tracing_disabled=True)
    ran: list[Any] = []
    for _ in range(TRIES):
        # The server ran the search inside the turn: the agent gets the call, its results and the answer.
        try:
            result = await agents.Runner.run(agent, "find", run_config=config, max_turns=1)
        except (agents.MaxTurnsExceeded, agents.ModelBehaviorError):
            continue  # the random model ran past max_tokens (an incomplete response): no answer in that turn
        calls = [item.raw_item for item in result.new_items if isinstance(item, agents.ToolCallItem)]
        assert calls and all(isinstance(c, Searched) for c in calls)
        ran = [c for c in calls if c.status == "completed"]
        if ran:
            break
    await client.close()
    assert ran, f"no forced call ran in {TRIES} tries"
    assert [(r.file_id, r.text) for r in ran[0].results or []] == [(file_id, SHORT_TEXT)]
    assert isinstance(result.final_output, str)
    assert capture.validate() > 0
