"""/v1/responses end to end: the official client, a real server, a real worker.

The tiny model has random weights, so its text is gibberish: assertions are
about shapes, statuses, usage arithmetic and what a grammar forces.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from supervisor.models.demo import write_tiny_gguf
from tests.server import Server, short_tempdir

EVENT = TypeAdapter(ResponseStreamEvent)
TERMINAL = ("response.completed", "response.incomplete", "response.failed")

# ChatML that renders tools and tool calls the Hermes / Qwen way.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these functions:\n<tools>"
    "{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>\n"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{%- if message.get('tool_calls') %}{% for call in message['tool_calls'] %}"
    "<tool_call>{\"name\": \"{{ call['function']['name'] }}\", \"arguments\": {{ call['function']['arguments'] }}}"
    "</tool_call>{% endfor %}{% else %}{{ message['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# A template whose generation prompt opens a think block (DeepSeek-R1 / QwQ style).
THINK_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)

WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                       "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}
PICK_FORMAT: Any = {
    "type": "json_schema",
    "name": "pick",
    "strict": True,
    "schema": {
        "type": "object",
        "properties": {"color": {"type": "string", "enum": ["red", "green"]}, "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
        "additionalProperties": False,
    },
}
CLOCK: Any = {"type": "function", "name": "get_time",
              "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}


def client_for(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return client_for(server)


@pytest.fixture(scope="module")
def tools_server() -> Iterator[Server]:
    """Serves "tools" (renders tools, Hermes style) and "think" (a reasoning template)."""
    models = short_tempdir("gvt")
    write_tiny_gguf(models / "tools.gguf", chat_template=TOOLS_TEMPLATE)
    write_tiny_gguf(models / "think.gguf", chat_template=THINK_TEMPLATE)
    srv = Server(models, env={"GPUVISOR_PRELOAD": "tools"}, model="tools").start()
    try:
        yield srv
    finally:
        srv.cleanup()


def stream_events(srv: Server, body: dict[str, Any]) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", srv.base_url + "/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                assert event["type"] == name
                events.append(event)
    return events


def validate_events(events: list[dict[str, Any]]) -> None:
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in TERMINAL and sum(t in TERMINAL for t in types) == 1
    for event in events:
        if event["type"] == "response.failed":
            # Our codes (worker_crashed, evicted) are outside the SDK's closed list.
            error = {**event["response"]["error"], "code": "server_error"}
            event = {**event, "response": {**event["response"], "error": error}}
        EVENT.validate_python(event)


def texts(page: Any) -> list[str]:
    """The text of each message item of an input_items page."""
    return [item.model_dump()["content"][0]["text"] for item in page.data]


def page_ids(page: Any) -> tuple[str, str]:
    dumped = page.model_dump()
    return dumped["first_id"], dumped["last_id"]


def check_usage(resp: Response) -> None:
    assert resp.usage is not None
    assert resp.usage.input_tokens > 0
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    assert 0 <= resp.usage.input_tokens_details.cached_tokens <= resp.usage.input_tokens


# ----------------------------------------------------------------- basics


def test_create_non_streaming(server: Server, client: openai.OpenAI) -> None:
    resp = client.responses.create(model=server.model, input="Say hello", max_output_tokens=16)
    assert resp.status in ("completed", "incomplete")
    assert resp.id.startswith("resp_") and resp.model == server.model
    check_usage(resp)
    assert resp.usage is not None and resp.usage.output_tokens <= 16
    if resp.output:
        message = resp.output[0]
        assert message.type == "message" and message.role == "assistant"
        assert message.content[0].type == "output_text" and message.content[0].annotations == []


def test_stream_events_are_typed_and_ordered(server: Server) -> None:
    events = stream_events(server, {"model": server.model, "input": "Count", "max_output_tokens": 24,
                                    "ignore_eos": True})
    validate_events(events)
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete"
    assert final["output"][0]["content"][0]["text"] == text
    assert final["usage"]["output_tokens"] == 24


def test_sdk_stream_true_and_stream_helper(server: Server, client: openai.OpenAI) -> None:
    kinds = [e.type for e in client.responses.create(model=server.model, input="hi", max_output_tokens=8,
                                                     stream=True)]
    assert kinds[0] == "response.created" and kinds[-1] in TERMINAL
    # A grammar-forced short answer always completes (get_final_response needs that).
    with client.responses.stream(model=server.model, input="hi", max_output_tokens=64,
                                 text={"format": PICK_FORMAT}) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == "".join(deltas)
    assert json.loads(final.output_text)["color"] in ("red", "green")
    check_usage(final)


def test_max_output_tokens_incomplete(server: Server, client: openai.OpenAI) -> None:
    resp = client.responses.create(model=server.model, input="go on", max_output_tokens=5,
                                   extra_body={"ignore_eos": True})
    assert resp.status == "incomplete"
    assert resp.incomplete_details is not None and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage is not None and resp.usage.output_tokens == 5


def test_json_schema_output(server: Server, client: openai.OpenAI) -> None:
    resp = client.responses.create(model=server.model, input="pick", max_output_tokens=64,
                                   text={"format": PICK_FORMAT})
    assert resp.status == "completed"
    value = json.loads(resp.output_text)
    assert set(value) == {"color", "ok"} and value["color"] in ("red", "green") and isinstance(value["ok"], bool)


def test_json_object_output(server: Server, client: openai.OpenAI) -> None:
    resp = client.responses.create(model=server.model, input="json", max_output_tokens=200,
                                   text={"format": {"type": "json_object"}})
    if resp.status == "completed":
        assert isinstance(json.loads(resp.output_text), dict)
    else:
        assert resp.status == "incomplete" and resp.output_text.lstrip().startswith("{")


def test_get_delete_and_input_items(server: Server, client: openai.OpenAI) -> None:
    items: Any = [{"role": "user", "content": f"m{i}"} for i in range(3)]
    resp = client.responses.create(model=server.model, input=items, max_output_tokens=4)
    assert client.responses.retrieve(resp.id).id == resp.id
    page = client.responses.input_items.list(resp.id, order="asc", limit=2)
    assert texts(page) == ["m0", "m1"]
    assert page.has_more and page_ids(page)[0] == page.data[0].id
    rest = client.responses.input_items.list(resp.id, order="asc", after=page_ids(page)[1])
    assert texts(rest) == ["m2"] and not rest.has_more
    client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"type": "mystery"}]}, "input[0].type"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": "x", "tools": [{"type": "custom", "name": "patch"}]}, "tools[0].type"),
    ],
)
def test_malformed_requests_name_the_field(server: Server, client: openai.OpenAI, body: dict[str, Any],
                                           param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=server.model, **body)
    assert err.value.body["param"] == param  # type: ignore[index]


def test_prompt_longer_than_the_context(server: Server, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=server.model, input="hello world " * 2000)
    assert err.value.body["code"] == "context_length_exceeded"  # type: ignore[index]
    assert err.value.body["param"] == "input"  # type: ignore[index]
    # Streamed too: the worker rejects it before prefill, so no 200 is committed.
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=server.model, input="hello world " * 2000, stream=True)
    assert err.value.body["code"] == "context_length_exceeded"  # type: ignore[index]
    assert err.value.body["param"] == "input"  # type: ignore[index]
    # The worker is free again: a normal request streams to the end.
    events = stream_events(server, {"model": server.model, "input": "hi", "max_output_tokens": 4})
    validate_events(events)
    assert events[-1]["type"] in ("response.completed", "response.incomplete")


def test_unknown_previous_response(server: Server, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=server.model, input="x", previous_response_id="resp_missing")
    assert err.value.body["code"] == "previous_response_not_found"  # type: ignore[index]


# ----------------------------------------------------------- conversation


def test_two_turns_survive_worker_and_parent_restarts(server: Server, client: openai.OpenAI) -> None:
    first = client.responses.create(model=server.model, input="Remember: blue", max_output_tokens=8)
    second = client.responses.create(model=server.model, input="Color?", previous_response_id=first.id,
                                     max_output_tokens=8)
    assert second.usage is not None and first.usage is not None
    # The second prompt holds the whole first turn.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens

    old_pid = server.kill_worker(server.model)
    server.wait_worker(lambda w: w["state"] == "ready" and w["pid"] != old_pid)
    third = client.responses.create(model=server.model, input="Again?", previous_response_id=second.id,
                                    max_output_tokens=8)
    assert third.status in ("completed", "incomplete") and third.usage is not None
    assert third.usage.input_tokens > second.usage.input_tokens

    server.restart()
    after = client_for(server)
    assert after.responses.retrieve(third.id).output_text == third.output_text
    fourth = after.responses.create(model=server.model, input="Last", previous_response_id=third.id,
                                    max_output_tokens=8)
    assert fourth.usage is not None and fourth.usage.input_tokens > third.usage.input_tokens


def test_worker_killed_mid_stream_fails_the_response(server: Server) -> None:
    body = {"model": server.model, "input": "long", "max_output_tokens": 900, "ignore_eos": True,
            "stream": True}
    server.wait_worker(lambda w: w["state"] == "ready")
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", server.base_url + "/v1/responses", json=body, timeout=60) as r:
        killed = False
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(json.loads(line[6:]))
            if not killed and events[-1]["type"] == "response.output_text.delta":
                server.kill_worker(server.model)
                killed = True
    validate_events(events)
    final = events[-1]
    assert final["type"] == "response.failed", "generation outran the kill"
    assert final["response"]["error"]["code"] == "server_error"
    assert final["response"]["error"]["cause"] == "worker_crashed"
    server.wait_worker(lambda w: w["state"] == "ready")


# ------------------------------------------------------------------ tools


def test_function_call_round_trip(tools_server: Server) -> None:
    client = client_for(tools_server)
    # One call exactly: with parallel calls allowed the random model may make two.
    first = client.responses.create(model=tools_server.model, input="Weather in Oslo?", tools=[WEATHER],
                                    tool_choice="required", parallel_tool_calls=False,
                                    max_output_tokens=200)
    assert first.status == "completed"
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1
    call = calls[0]
    assert call.name == "get_weather" and call.call_id and call.id
    args = json.loads(call.arguments)
    assert args["city"] in ("Paris", "Oslo") and args["unit"] in ("c", "f")

    final = client.responses.create(
        model=tools_server.model, previous_response_id=first.id, tools=[WEATHER], max_output_tokens=16,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "12 degrees"}],
    )
    assert final.status in ("completed", "incomplete")
    assert final.usage is not None and first.usage is not None
    assert final.usage.input_tokens > first.usage.input_tokens


def test_named_tool_choice_and_streamed_call(tools_server: Server) -> None:
    body = {"model": tools_server.model, "input": "time?", "tools": [WEATHER, CLOCK],
            "tool_choice": {"type": "function", "name": "get_time"}, "max_output_tokens": 200}
    events = stream_events(tools_server, body)
    validate_events(events)
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0]["name"] == "get_time"
    assert isinstance(json.loads(done[0]["arguments"]), dict)
    assert events[-1]["response"]["output"][-1]["type"] == "function_call"


def test_reasoning_model_output_is_a_reasoning_item(tools_server: Server) -> None:
    body = {"model": "think", "input": "why?", "reasoning": {"effort": "low"}, "max_output_tokens": 20,
            "ignore_eos": True}
    events = stream_events(tools_server, body)
    validate_events(events)
    final = events[-1]["response"]
    first = final["output"][0]
    assert first["type"] == "reasoning" and first["content"][0]["type"] == "reasoning_text"
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert streamed == first["content"][0]["text"]
    usage = final["usage"]
    assert 0 < usage["output_tokens_details"]["reasoning_tokens"] <= usage["output_tokens"] == 20


# ------------------------------------------------------------- background


def wait_status(client: openai.OpenAI, rid: str, statuses: tuple[str, ...], timeout: float = 30) -> Response:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        resp = client.responses.retrieve(rid)
        if resp.status in statuses:
            return resp
        time.sleep(0.05)
    raise AssertionError(f"{rid} stuck in {resp.status}")


def test_background_poll_and_cancel(server: Server, client: openai.OpenAI) -> None:
    queued = client.responses.create(model=server.model, input="bg", background=True, max_output_tokens=8)
    assert queued.status == "queued"
    done = wait_status(client, queued.id, ("completed", "incomplete", "failed"))
    assert done.status in ("completed", "incomplete")

    long = client.responses.create(model=server.model, input="bg", background=True, max_output_tokens=900,
                                   extra_body={"ignore_eos": True})
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(long.id).status == "cancelled"
