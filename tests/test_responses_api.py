"""The Responses API over real HTTP and real SQLite, with a scripted pool.

The pool is the only fake (``tests/responses_fake.py``): it replays deltas,
errors and delays, so event order, storage, background runs, keepalives and
failures are tested exactly and fast. The same behaviour against the real
worker is in ``test_responses_e2e.py``.
"""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import aiohttp
import msgspec
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from backports import zstd
from openai.types.responses import Response, ResponseItem, ResponseStreamEvent
from pydantic import TypeAdapter

from supervisor import appkeys
from supervisor.api.responses import setup
from supervisor.app import error_middleware
from supervisor.appkeys import RESPONSES
from supervisor.config import Config
from supervisor.db import Database
from supervisor.errors import UpstreamError
from supervisor.responses import RESPONSES_SCHEMA
from supervisor.responses.background import BackgroundTasks
from supervisor.responses.models import CreateRequest, decode_items
from supervisor.responses.objects import new_response
from supervisor.responses.store import ResponseStore
from supervisor.workers.pool import WorkerPool
from supervisor.workers.replies import Blame, Rejected
from tests.responses_fake import MODEL, FakePool
from worker.protocol import ChatMessage, Delta, Done

EVENT = TypeAdapter(ResponseStreamEvent)
ITEM = TypeAdapter(ResponseItem)
THINK_TOOLS_TEMPLATE = "{{ tools }}{{ messages }}{% if enable_thinking %}<think>{% endif %}<tool_call>"

@dataclass
class Api:
    pool: FakePool
    url: str
    db_path: Path
    client: openai.AsyncOpenAI
    app: web.Application


def build_app(pool: FakePool, db_path: Path, keepalive_s: float) -> web.Application:
    app = web.Application(middlewares=[error_middleware])
    app[appkeys.CONFIG] = Config(state_dir=str(db_path.parent), max_body_bytes=1 << 20)

    async def resources(app: web.Application) -> AsyncIterator[None]:
        db = Database(db_path, [RESPONSES_SCHEMA])
        await db.open()
        app[appkeys.DB] = db
        app[appkeys.POOL] = cast(WorkerPool, pool)
        yield
        await db.close()

    app.cleanup_ctx.append(resources)
    setup(app, keepalive_s=keepalive_s)
    return app


async def serve(app: web.Application) -> TestServer:
    # TestServer cancels the handler of a client that leaves, as the real server does.
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[Api]:
    pool = FakePool()
    pool.say("Hello", " world")
    app = build_app(pool, tmp_path / "gv.db", keepalive_s=0.05)
    server = await serve(app)
    url = f"http://127.0.0.1:{server.port}"
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    try:
        yield Api(pool, url, tmp_path / "gv.db", client, app)
    finally:
        await client.close()
        await server.close()


async def raw_events(url: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """POST a streaming request; the decoded events and the raw SSE text."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + "/v1/responses", json={**body, "stream": True}) as resp,
    ):
        assert resp.status == 200, await resp.text()
        raw = await resp.text()
    events = []
    for frame in raw.split("\n\n"):
        lines = frame.split("\n")
        names = [ln[7:] for ln in lines if ln.startswith("event: ")]
        data = [ln[6:] for ln in lines if ln.startswith("data: ")]
        if data:
            event = json.loads(data[0])
            assert names == [event["type"]]
            events.append(event)
    return events, raw


def texts(page: Any) -> list[str]:
    """The text of each message item of an input_items page."""
    return [item.model_dump()["content"][0]["text"] for item in page.data]


def page_ids(page: Any) -> tuple[str, str]:
    dumped = page.model_dump()
    return dumped["first_id"], dumped["last_id"]


def check_sequence(events: list[dict[str, Any]]) -> None:
    """Contiguous sequence numbers, typed events and the documented order."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        # Strict: the error code must be in the SDK's closed list as it is.
        EVENT.validate_python(event, strict=True)
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete", "response.failed")
    assert sum(t in ("response.completed", "response.incomplete", "response.failed") for t in types) == 1
    body = types[2:-1]
    i = 0
    while i < len(body):
        assert body[i] == "response.output_item.added"
        j = body.index("response.output_item.done", i)
        inner = body[i + 1 : j]
        if inner and inner[0] == "response.content_part.added":
            kind = "output_text" if "response.output_text.done" in inner else "reasoning_text"
            assert inner[-2:] == [f"response.{kind}.done", "response.content_part.done"]
            assert set(inner[1:-2]) <= {f"response.{kind}.delta"}
        else:
            assert inner[-1] == "response.function_call_arguments.done"
            assert set(inner[:-1]) <= {"response.function_call_arguments.delta"}
        i = j + 1


# ------------------------------------------------------------------- create


async def test_create_and_retrieve(api: Api) -> None:
    resp = await api.client.responses.create(model=MODEL, input="hi", instructions="be brief", metadata={"k": "v"})
    assert resp.status == "completed" and resp.output_text == "Hello world"
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.usage is not None
    assert (resp.usage.input_tokens, resp.usage.output_tokens, resp.usage.total_tokens) == (7, 2, 9)
    assert resp.usage.input_tokens_details.cached_tokens == 2
    assert resp.metadata == {"k": "v"} and resp.instructions == "be brief"
    Response.model_validate(resp.model_dump())
    again = await api.client.responses.retrieve(resp.id)
    assert again.model_dump() == resp.model_dump()
    assert api.pool.calls[0].messages == [
        ChatMessage(role="system", content="be brief"),
        ChatMessage(role="user", content="hi"),
    ]


async def test_stream_events_validate_in_order(api: Api) -> None:
    events, _ = await raw_events(api.url, {"model": MODEL, "input": "hi"})
    check_sequence(events)
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(deltas) == "Hello world"
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == "Hello world"


async def test_sdk_stream_helper(api: Api) -> None:
    async with api.client.responses.stream(model=MODEL, input="hi") as stream:
        seen = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert seen[0] == "response.created" and seen[-1] == "response.completed"
    assert final.output_text == "Hello world"
    stored = await api.client.responses.retrieve(final.id)
    assert stored.output_text == "Hello world"


async def test_reasoning_and_tool_call(api: Api) -> None:
    api.pool.template = THINK_TOOLS_TEMPLATE
    api.pool.say("<think>", "need weather", "</think>\n", '<tool_call>{"name": "get_weather", ',
                 '"arguments": {"city": "Oslo"}}</tool_call>')
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    body = {"model": MODEL, "input": "weather?", "tools": tools, "reasoning": {"effort": "low"}}
    events, _ = await raw_events(api.url, body)
    check_sequence(events)
    output = events[-1]["response"]["output"]
    assert [item["type"] for item in output] == ["reasoning", "function_call"]
    assert output[0]["content"] == [{"type": "reasoning_text", "text": "need weather"}]
    assert output[1]["name"] == "get_weather" and json.loads(output[1]["arguments"]) == {"city": "Oslo"}
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert done["name"] == "get_weather"
    call = api.pool.calls[0]
    assert call.template_vars == {"enable_thinking": True}
    assert call.tools == [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    usage = events[-1]["response"]["usage"]
    assert usage["output_tokens_details"]["reasoning_tokens"] == 2


async def test_function_call_round_trip(api: Api) -> None:
    api.pool.template = THINK_TOOLS_TEMPLATE
    api.pool.say('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    tools: Any = [{"type": "function", "name": "add", "parameters": {"type": "object"}}]
    first = await api.client.responses.create(model=MODEL, input="add", tools=tools)
    call = first.output[0]
    assert call.type == "function_call"
    api.pool.say("It is 1.")
    second = await api.client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=tools,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "1"}],
    )
    assert second.output_text == "It is 1."
    sent = api.pool.calls[1].messages
    assert [m.role for m in sent] == ["user", "assistant", "tool"]
    assert sent[1].tool_calls and sent[1].tool_calls[0]["id"] == call.call_id
    assert sent[2].tool_call_id == call.call_id and sent[2].name == "add"


async def test_tool_choice_required_sends_a_grammar(api: Api) -> None:
    api.pool.say('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>')
    tools: Any = [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}]
    resp = await api.client.responses.create(model=MODEL, input="x", tools=tools, tool_choice="required")
    assert resp.output[0].type == "function_call"
    grammar = api.pool.calls[0].params.grammar
    assert grammar is not None and '"<tool_call>\\n"' in grammar and '\\"f\\"' in grammar


async def test_json_schema_is_passed_to_the_worker(api: Api) -> None:
    api.pool.say('{"ok": true}')
    schema: Any = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    resp = await api.client.responses.create(
        model=MODEL, input="x", text={"format": {"type": "json_schema", "name": "r", "schema": schema, "strict": True}}
    )
    assert json.loads(resp.output_text) == {"ok": True}
    assert json.loads(api.pool.calls[0].params.json_schema or "") == schema


async def test_max_output_tokens_gives_incomplete(api: Api) -> None:
    api.pool.say("a", "b", finish="length")
    events, _ = await raw_events(api.url, {"model": MODEL, "input": "x", "max_output_tokens": 2})
    check_sequence(events)
    final = events[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["response"]["output"][0]["status"] == "incomplete"
    assert api.pool.calls[0].params.max_tokens == 2


async def test_worker_crash_mid_stream_fails_the_response(api: Api) -> None:
    api.pool.script = [Delta(0, "par", 1), UpstreamError("worker died", code="worker_crashed")]
    events, _ = await raw_events(api.url, {"model": MODEL, "input": "x"})
    check_sequence(events)
    final = events[-1]
    assert final["type"] == "response.failed"
    assert final["response"]["error"]["code"] == "server_error"
    assert final["response"]["error"]["cause"] == "worker_crashed"
    assert final["response"]["output"][0]["content"][0]["text"] == "par"
    stored = await api.client.responses.retrieve(final["response"]["id"])
    assert stored.status == "failed"


async def test_keepalive_during_slow_prefill(api: Api) -> None:
    api.pool.script = [0.3, Delta(0, "late", 1), Done(0, "stop", 1, 1)]
    events, raw = await raw_events(api.url, {"model": MODEL, "input": "x"})
    check_sequence(events)
    assert ": keepalive\n\n" in raw
    assert raw.index(": keepalive") < raw.index("response.output_text.delta")


async def test_prompt_the_worker_rejects_is_a_400_before_the_stream(api: Api) -> None:
    api.pool.accept = Rejected("the prompt has 9000 tokens; the model's context is 2048",
                               code="context_length_exceeded", cause=Blame.PROMPT)
    with pytest.raises(openai.BadRequestError) as err:
        await api.client.responses.create(model=MODEL, input="x", stream=True)
    assert err.value.body["code"] == "context_length_exceeded"  # type: ignore[index]
    assert err.value.body["param"] == "input"  # type: ignore[index]
    assert [out.closed for out in api.pool.admitted] == [True], "the rejected generation is withdrawn"


async def test_a_request_still_queued_streams_after_the_keepalive_interval(api: Api) -> None:
    # The worker takes it only after 30 s: the stream must not wait for that.
    api.pool.accept = 30.0
    started = asyncio.get_running_loop().time()
    events, _ = await raw_events(api.url, {"model": MODEL, "input": "x"})
    check_sequence(events)
    assert events[-1]["type"] == "response.completed"
    assert asyncio.get_running_loop().time() - started < 10


async def test_client_disconnect_cancels_generation(api: Api) -> None:
    api.pool.script = [Delta(0, "a", 1), 5.0, Done(0, "stop", 1, 1)]
    body = {"model": MODEL, "input": "x", "stream": True}
    async with aiohttp.ClientSession() as session, session.post(api.url + "/v1/responses", json=body) as r:
        await r.content.readuntil(b"response.output_text.delta")
    for _ in range(200):
        if api.pool.closed:
            break
        await asyncio.sleep(0.02)
    assert api.pool.closed == 1


# ------------------------------------------------------------ conversation


async def test_previous_response_chain(api: Api) -> None:
    first = await api.client.responses.create(model=MODEL, input="one", instructions="first only")
    api.pool.say("second answer")
    second = await api.client.responses.create(model=MODEL, input="two", previous_response_id=first.id)
    await api.client.responses.create(model=MODEL, input="three", previous_response_id=second.id)
    sent = api.pool.calls[2].messages
    assert [(m.role, m.content) for m in sent] == [
        ("user", "one"), ("assistant", "Hello world"), ("user", "two"), ("assistant", "second answer"),
        ("user", "three"),
    ]


async def test_unknown_previous_response(api: Api) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        await api.client.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")
    assert err.value.body["code"] == "previous_response_not_found"  # type: ignore[index]
    assert err.value.body["param"] == "previous_response_id"  # type: ignore[index]


async def test_store_false_writes_nothing(api: Api) -> None:
    resp = await api.client.responses.create(model=MODEL, input="x", store=False)
    assert resp.status == "completed"
    with pytest.raises(openai.NotFoundError):
        await api.client.responses.retrieve(resp.id)
    db = api.app[appkeys.DB]
    async with db.conn.execute("SELECT COUNT(*) FROM responses") as cur:
        assert (await cur.fetchone())[0] == 0  # type: ignore[index]


async def test_unknown_model_is_404(api: Api) -> None:
    with pytest.raises(openai.NotFoundError):
        await api.client.responses.create(model="nope", input="x")
    with pytest.raises(openai.NotFoundError):
        await api.client.responses.create(model="nope", input="x", stream=True)


async def test_delete_and_input_items(api: Api) -> None:
    items: Any = [{"role": "user", "content": f"m{i}"} for i in range(5)]
    resp = await api.client.responses.create(model=MODEL, input=items)
    page = await api.client.responses.input_items.list(resp.id, order="asc", limit=2)
    assert texts(page) == ["m0", "m1"]
    assert page.has_more and page_ids(page) == (page.data[0].id, page.data[1].id)
    rest = await api.client.responses.input_items.list(resp.id, order="asc", after=page_ids(page)[1], limit=10)
    assert texts(rest) == ["m2", "m3", "m4"]
    assert not rest.has_more
    desc = await api.client.responses.input_items.list(resp.id)
    assert texts(desc) == ["m4", "m3", "m2", "m1", "m0"]
    for item in desc.data:
        ITEM.validate_python(item.model_dump())
    await api.client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError):
        await api.client.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError):
        await api.client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError):
        await api.client.responses.input_items.list(resp.id)


async def test_input_items_bad_query(api: Api) -> None:
    resp = await api.client.responses.create(model=MODEL, input="x")
    async with aiohttp.ClientSession() as session:
        for query, param in [("limit=0", "limit"), ("limit=x", "limit"), ("order=up", "order"), ("after=zz", "after")]:
            async with session.get(f"{api.url}/v1/responses/{resp.id}/input_items?{query}") as r:
                assert r.status in (400, 404)
                assert (await r.json())["error"]["param"] == param


# -------------------------------------------------------------- background


async def poll(client: openai.AsyncOpenAI, rid: str, until: Callable[[str], bool]) -> Response:
    for _ in range(500):
        resp = await client.responses.retrieve(rid)
        if until(resp.status or ""):
            return resp
        await asyncio.sleep(0.01)
    raise AssertionError(f"response {rid} stuck in {resp.status}")


async def test_background_runs_to_completion(api: Api) -> None:
    api.pool.script = [0.1, Delta(0, "bg", 1), Done(0, "stop", 3, 1)]
    resp = await api.client.responses.create(model=MODEL, input="x", background=True)
    assert resp.status == "queued" and resp.background
    final = await poll(api.client, resp.id, lambda s: s in ("completed", "failed"))
    assert final.status == "completed" and final.output_text == "bg"


async def test_background_cancel(api: Api) -> None:
    api.pool.script = [Delta(0, "a", 1), 30.0, Done(0, "stop", 1, 1)]
    resp = await api.client.responses.create(model=MODEL, input="x", background=True)
    await poll(api.client, resp.id, lambda s: s == "in_progress")
    cancelled = await api.client.responses.cancel(resp.id)
    assert cancelled.status == "cancelled"
    assert (await api.client.responses.retrieve(resp.id)).status == "cancelled"
    assert api.pool.closed == 1
    # Cancelling again is a no-op; a finished foreground response cannot be cancelled.
    assert (await api.client.responses.cancel(resp.id)).status == "cancelled"
    api.pool.say("x")
    done = await api.client.responses.create(model=MODEL, input="x")
    with pytest.raises(openai.BadRequestError):
        await api.client.responses.cancel(done.id)


async def test_background_bad_conversation_is_a_400(api: Api) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        await api.client.responses.create(
            model=MODEL, background=True, input=[{"type": "function_call_output", "call_id": "c", "output": "x"}]
        )
    assert err.value.body["param"] == "input[0].call_id"  # type: ignore[index]


async def test_background_unknown_model_fails(api: Api) -> None:
    resp = await api.client.responses.create(model="nope", input="x", background=True)
    final = await poll(api.client, resp.id, lambda s: s == "failed")
    assert final.error is not None and final.error.code == "server_error"
    assert final.error.model_dump()["cause"] == "model_not_found"


async def test_shutdown_interrupts_background_and_restart_keeps_the_rest(tmp_path: Path) -> None:
    pool = FakePool()
    pool.say("kept")
    db_path = tmp_path / "gv.db"
    app = build_app(pool, db_path, keepalive_s=10)
    server = await serve(app)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)
    first = await client.responses.create(model=MODEL, input="keep me")
    pool.script = [60.0]
    running = await client.responses.create(model=MODEL, input="x", background=True)
    await poll(client, running.id, lambda s: s == "in_progress")
    await client.close()
    await server.close()

    pool.say("again")
    app = build_app(pool, db_path, keepalive_s=10)
    server = await serve(app)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)
    try:
        interrupted = await client.responses.retrieve(running.id)
        assert interrupted.status == "failed" and interrupted.error is not None
        assert interrupted.error.code == "server_error"
        assert interrupted.error.model_dump()["cause"] == "interrupted"
        follow = await client.responses.create(model=MODEL, input="more", previous_response_id=first.id)
        assert follow.output_text == "again"
        assert [m.content for m in pool.calls[-1].messages] == ["keep me", "kept", "more"]
    finally:
        await client.close()
        await server.close()


# ------------------------------------------------------------------ input


@pytest.mark.parametrize("encoding", ["gzip", "zstd"])
async def test_compressed_body(api: Api, encoding: str) -> None:
    raw = msgspec.json.encode({"model": MODEL, "input": "zipped"})
    body = gzip.compress(raw) if encoding == "gzip" else zstd.compress(raw)
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        headers = {"Content-Encoding": encoding, "Content-Type": "application/json"}
        async with session.post(api.url + "/v1/responses", data=body, headers=headers) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["status"] == "completed"
    assert api.pool.calls[0].messages[-1].content == "zipped"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"type": "nope"}]}, "input[0].type"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
        # Hosted tools are accepted (never offered to the model); a custom tool is refused.
        ({"input": "x", "tools": [{"type": "custom", "name": "patch"}]}, "tools[0].type"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input[0].call_id"),
    ],
)
async def test_malformed_input_names_the_field(api: Api, body: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        await api.client.responses.create(model=MODEL, **body)
    assert err.value.body["param"] == param  # type: ignore[index]
    assert api.pool.calls == []


async def test_prune_removes_old_finished_responses(api: Api) -> None:
    old = await api.client.responses.create(model=MODEL, input="x")
    store = ResponseStore(api.app[appkeys.DB])
    assert await store.prune(older_than=old.created_at - 1) == 0
    assert await store.prune(older_than=old.created_at + 1) == 1
    assert await store.get(old.id) is None
    assert api.app[RESPONSES].retention_s == 30 * 24 * 3600


async def test_prune_once_follows_retention_and_clock(tmp_path: Path) -> None:
    db = Database(tmp_path / "p.db", [RESPONSES_SCHEMA])
    await db.open()
    try:
        store = ResponseStore(db)
        await store.ensure_schema()  # the later responses migrations (events, owner)
        now = 1_000_000.0
        tasks = BackgroundTasks(store, retention_s=100, clock=lambda: now)
        req = CreateRequest(model=MODEL, input="x")
        old = new_response(req, now - 150, "completed")
        fresh = new_response(req, now - 50, "completed")
        running = new_response(req, now - 500, "in_progress")
        for resp in (old, fresh, running):
            await store.save(resp, decode_items("x"))
        assert await tasks.prune_once() == 1
        assert await store.get(old.id) is None
        assert await store.get(fresh.id) is not None and await store.get(running.id) is not None
    finally:
        await db.close()
