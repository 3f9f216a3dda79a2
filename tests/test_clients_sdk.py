"""The official SDK against a real server: what strict clients check.

Every response body and stream event the SDK receives here (and in the other
client tests, which share :class:`Capture`) is validated against the SDK's
own pydantic types in strict mode. Covered: namespace and hosted tools,
forced calls cut by the token limit in each model family's own format,
background responses streamed, left and resumed (also across a restart),
``truncation: "auto"``, ``reasoning.effort: "max"``, logprobs,
``allowed_tools`` and structured outputs through ``parse``.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Literal

import httpx
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from supervisor.generation.parse import Reasoning, Text, ToolCall
from supervisor.generation.profile import profile_for
from supervisor.generation.tools import FunctionTool
from supervisor.models.demo import write_tiny_gguf
from supervisor.responses.runner import tool_plan
from tests.real_templates import FAMILIES, MARKUP, Family, by_name
from tests.real_templates import WEATHER as REAL_WEATHER
from tests.server import Server, running, short_tempdir
from worker.protocol import SamplingParams

pytestmark = pytest.mark.timeout(180)

# ------------------------------------------------------- strict validation

_EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def _sse_data(body: bytes) -> list[str]:
    lines = body.decode().splitlines()
    return [line[6:] for line in lines if line.startswith("data: ") and line != "data: [DONE]"]


def validate_strictly(method: str, path: str, status: int, content_type: str, body: bytes) -> int:
    """Validate one captured reply; the number of objects checked."""
    if status >= 400 or method == "DELETE" or path.endswith("/input_items") or not path.startswith("/v1/"):
        return 0
    chat = path.endswith("/chat/completions")
    legacy = path.endswith("/v1/completions")
    if not (chat or legacy) and not path.startswith("/v1/responses"):
        return 0
    if content_type.startswith("text/event-stream"):
        events = [json.loads(data) for data in _sse_data(body)]
        for event in events:
            if chat:
                ChatCompletionChunk.model_validate(event, strict=True)
            elif legacy:
                # The SDK reads chunks as Completion objects, whose finish_reason
                # is never null; OpenAI's own chunks have it null until the end.
                Completion.model_validate({**event, "choices": [
                    {**c, "finish_reason": c["finish_reason"] or "stop"} for c in event["choices"]]}, strict=True)
            else:
                _EVENT.validate_python(event, strict=True)
        return len(events)
    obj = json.loads(body)
    (ChatCompletion if chat else Completion if legacy else Response).model_validate(obj, strict=True)
    return 1


class Capture:
    """Records every reply an SDK client receives, for strict validation."""

    def __init__(self) -> None:
        self.replies: list[tuple[str, str, int, str, bytes]] = []

    def record(self, request: httpx.Request, response: httpx.Response, body: bytes) -> None:
        self.replies.append((request.method, request.url.path, response.status_code,
                             response.headers.get("content-type", ""), body))

    def validate(self) -> int:
        return sum(validate_strictly(*reply) for reply in self.replies)

    def client(self, base_url: str) -> openai.OpenAI:
        http = httpx.Client(transport=_Tee(self), timeout=120)
        return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, http_client=http)

    def async_client(self, base_url: str) -> openai.AsyncOpenAI:
        http = httpx.AsyncClient(transport=_AsyncTee(self), timeout=120)
        return openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, http_client=http)


class _Recorded(httpx.SyncByteStream):
    def __init__(self, inner: httpx.SyncByteStream, done: Callable[[bytes], None]) -> None:
        self._inner, self._done, self._chunks = inner, done, list[bytes]()

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._inner:
            self._chunks.append(chunk)
            yield chunk

    def close(self) -> None:
        self._inner.close()
        self._done(b"".join(self._chunks))


class _AsyncRecorded(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, done: Callable[[bytes], None]) -> None:
        self._inner, self._done, self._chunks = inner, done, list[bytes]()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._inner:
            self._chunks.append(chunk)
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()
        self._done(b"".join(self._chunks))


def _wrapped(response: httpx.Response, request: httpx.Request, stream: Any) -> httpx.Response:
    return httpx.Response(response.status_code, headers=response.headers, stream=stream, request=request,
                          extensions=response.extensions)


class _Tee(httpx.BaseTransport):
    def __init__(self, capture: Capture) -> None:
        self._capture, self._inner = capture, httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self._inner.handle_request(request)
        assert isinstance(response.stream, httpx.SyncByteStream)
        stream = _Recorded(response.stream, lambda body: self._capture.record(request, response, body))
        return _wrapped(response, request, stream)


class _AsyncTee(httpx.AsyncBaseTransport):
    def __init__(self, capture: Capture) -> None:
        self._capture, self._inner = capture, httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._inner.handle_async_request(request)
        assert isinstance(response.stream, httpx.AsyncByteStream)
        stream = _AsyncRecorded(response.stream, lambda body: self._capture.record(request, response, body))
        return _wrapped(response, request, stream)


@pytest.fixture
def capture() -> Iterator[Capture]:
    """A recorder whose every reply must validate strictly once the test is done."""
    recorded = Capture()
    yield recorded
    assert recorded.validate() > 0


# ----------------------------------------------------------------- server

# A family per tool-call style: Hermes, Mistral, Llama 3, harmony, DeepSeek.
STYLES = ["qwen2.5-instruct", "mistral-nemo-instruct", "llama3.1-instruct", "gpt-oss", "deepseek-r1-distill-qwen"]


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    """One server: the plain tiny model ("tiny", ChatML) and one per tool-call style."""
    models = short_tempdir("gvc")
    write_tiny_gguf(models / "tiny.gguf", n_ctx=4096)
    for name in STYLES:
        write_tiny_gguf(models / f"{name}.gguf", chat_template=by_name(name).template, n_ctx=4096)
    env = {"GPUVISOR_N_CTX": "4096", "GPUVISOR_MAX_LOADED_MODELS": str(len(STYLES) + 1),
           "GPUVISOR_PARALLEL": "1"}
    with running(Server(models, env=env, model="tiny")) as server:
        yield server


def no_markup(text: str | None) -> bool:
    return not any(m in (text or "") for m in MARKUP)


WEATHER_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMS}
CHAT_WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}}
CHAT_TIME = {"type": "function", "function": {"name": "get_time"}}
AGENTS = {
    "type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.",
    "tools": [{"type": "function", "name": "spawn_agent", "strict": False, "description": "Start one.",
               "parameters": {"type": "object", "properties": {"task": {"type": "string", "enum": ["a", "b"]}},
                              "required": ["task"], "additionalProperties": False}},
              {"type": "function", "name": "close_agent", "parameters": {"type": "object", "properties": {}}}],
}
HOSTED: list[dict[str, Any]] = [
    {"type": "image_generation"},
    {"type": "local_shell"},
    # Off on this server: not offered, and no 400 (agent clients such as the
    # Codex CLI send web_search whatever the server runs).
    {"type": "web_search"},
    {"type": "file_search", "vector_store_ids": ["vs_1"]},
    {"type": "code_interpreter", "container": {"type": "auto"}},
]


# ---------------------------------------------------- 1. namespaces, hosted


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_namespaced_functions_are_offered_and_hosted_tools_accepted(srv: Server, capture: Capture,
                                                                      stream: bool) -> None:
    client = capture.client(srv.base_url)
    tools: Any = [AGENTS, *HOSTED]
    choice: Any = {"type": "function", "name": "spawn_agent"}
    kwargs: dict[str, Any] = {"model": "tiny", "input": "start one", "tools": tools, "tool_choice": choice,
                              "max_output_tokens": 200}
    if stream:
        with client.responses.stream(**kwargs) as events:
            made = events.get_final_response()
    else:
        made = client.responses.create(**kwargs)
    [call] = [o for o in made.output if o.type == "function_call"]
    assert (call.namespace, call.name, json.loads(call.arguments)["task"] in ("a", "b")) == (
        "multi_agent_v1", "spawn_agent", True)
    # The response lists the tools the model may call; hosted ones never are.
    assert [t.type for t in made.tools] == ["namespace"]
    # The call and its result, sent back (as Codex does, store off), make a second turn.
    history: Any = [{"role": "user", "content": "start one"}, call.model_dump(exclude_none=True),
                    {"type": "function_call_output", "call_id": call.call_id, "output": "started"}]
    after = client.responses.create(model="tiny", input=history, tools=tools, store=False, max_output_tokens=4)
    assert after.status in ("completed", "incomplete") and after.usage is not None
    assert after.usage.input_tokens > (made.usage.input_tokens if made.usage else 0)


def test_allowed_tools_narrow_what_is_offered(srv: Server, capture: Capture) -> None:
    client = capture.client(srv.base_url)
    tools: Any = [WEATHER, AGENTS, HOSTED[0]]
    allowed: Any = {"type": "allowed_tools", "mode": "required",
                    "tools": [{"type": "function", "name": "close_agent"}, {"type": "web_search"}]}
    made = client.responses.create(model="tiny", input="x", tools=tools, tool_choice=allowed,
                                   parallel_tool_calls=False, max_output_tokens=200)
    assert [(o.type, o.namespace, o.name) for o in made.output if o.type == "function_call"] == [
        ("function_call", "multi_agent_v1", "close_agent")]
    chat_allowed: Any = {"type": "allowed_tools", "allowed_tools": {
        "mode": "required", "tools": [{"type": "function", "function": {"name": "get_time"}}]}}
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                           tools=[CHAT_WEATHER, CHAT_TIME], tool_choice=chat_allowed,
                                           parallel_tool_calls=False, max_tokens=200)
    assert [c.function.name for c in reply.choices[0].message.tool_calls or []] == ["get_time"]
    with pytest.raises(openai.BadRequestError) as err:
        bad: Any = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "nope"}]}
        client.responses.create(model="tiny", input="x", tools=tools, tool_choice=bad)
    assert err.value.body["param"] == "tool_choice.tools[0].name"  # type: ignore[index]


# ------------------------------------------------------ 2. calls cut short


def _check_cut_chat(message: Any, finish: str) -> None:
    assert message.content is None and finish == "length"
    [call] = message.tool_calls
    assert call.function.name == "get_weather" and no_markup(call.function.arguments)
    assert '{"city": "Paris"}'.startswith(call.function.arguments) or \
        '{"city": "Oslo"}'.startswith(call.function.arguments)


@pytest.mark.parametrize("max_tokens", [3, 12, 30])
@pytest.mark.parametrize("family", STYLES)
def test_a_forced_call_cut_by_max_tokens_is_a_partial_call(srv: Server, capture: Capture, family: str,
                                                            max_tokens: int) -> None:
    client = capture.client(srv.base_url)
    chat: Any = {"model": family, "max_tokens": max_tokens, "messages": [{"role": "user", "content": "w"}],
                 "tool_choice": "required", "tools": [CHAT_WEATHER], "parallel_tool_calls": False}
    whole = client.chat.completions.create(**chat)
    if whole.choices[0].finish_reason == "length":
        _check_cut_chat(whole.choices[0].message, "length")
    with client.chat.completions.stream(**chat) as stream:
        for _ in stream:
            pass
        snapshot: Any = stream.current_completion_snapshot.choices[0]
    if snapshot.finish_reason == "length":
        _check_cut_chat(snapshot.message, snapshot.finish_reason)
    tools: Any = [WEATHER]
    made = client.responses.create(model=family, input="w", tools=tools, tool_choice="required",
                                   parallel_tool_calls=False, max_output_tokens=max_tokens)
    assert all(o.type == "function_call" for o in made.output), made.output
    [call] = made.output
    assert call.type == "function_call" and call.name == "get_weather" and no_markup(call.arguments)
    assert (made.status, call.status) in (("incomplete", "incomplete"), ("completed", "completed"))


# --------------------------------------------------- 3. background streams


def _collect(events: Any, limit: int | None = None) -> list[Any]:
    out = []
    for event in events:
        out.append(event)
        if limit is not None and len(out) == limit:
            break
    return out


def test_a_background_stream_can_be_left_and_resumed(srv: Server, capture: Capture) -> None:
    client = capture.client(srv.base_url)
    stream = client.responses.create(model="tiny", input="go", background=True, stream=True,
                                     max_output_tokens=60, extra_body={"ignore_eos": True})
    first = _collect(stream, limit=5)
    stream.close()  # the client leaves; the response goes on
    assert [e.type for e in first[:3]] == ["response.created", "response.queued", "response.in_progress"]
    response_id = first[0].response.id
    rest = _collect(client.responses.retrieve(response_id, stream=True, starting_after=4))
    events = first + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.incomplete"
    final = client.responses.retrieve(response_id)
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == streamed and final.status == "incomplete"
    # Finished: the stored events replay from any point.
    again = _collect(client.responses.retrieve(response_id, stream=True, starting_after=10))
    assert [e.sequence_number for e in again] == list(range(11, len(events)))
    with pytest.raises(openai.BadRequestError) as err:
        foreground = client.responses.create(model="tiny", input="x", max_output_tokens=2)
        client.responses.retrieve(foreground.id, stream=True)
    assert err.value.body["param"] == "stream"  # type: ignore[index]


def test_background_events_survive_a_restart(capture: Capture, start_server: Callable[..., Server]) -> None:
    models = short_tempdir("gvm")
    # A context long enough that the generation is still running when the service is killed.
    write_tiny_gguf(models / "tiny.gguf", n_ctx=16384)
    server = start_server(models, env={"GPUVISOR_N_CTX": "16384"})
    client = capture.client(server.base_url)
    stream = client.responses.create(model=server.model, input="go", background=True, stream=True,
                                     max_output_tokens=100_000, extra_body={"ignore_eos": True})
    # Long enough for a few batches of events to be stored.
    started = time.monotonic()
    seen = []
    for event in stream:
        seen.append(event)
        if time.monotonic() - started > 0.8:
            break
    # Killed outright: nothing gets to record the end; the next start does.
    server.stop(signal.SIGKILL)
    server.start()
    client = capture.client(server.base_url)
    replayed = _collect(client.responses.retrieve(seen[0].response.id, stream=True, starting_after=-1))
    numbers = [e.sequence_number for e in replayed]
    assert numbers == list(range(len(replayed))) and len(replayed) > 3
    # What was stored before the kill is what the client saw; then the restart's failure.
    assert [(e.type, e.sequence_number) for e in replayed[:-1]] == [
        (e.type, e.sequence_number) for e in seen[: len(replayed) - 1]]
    assert replayed[-1].type == "response.failed"
    assert replayed[-1].response.error is not None
    assert client.responses.retrieve(seen[0].response.id).status == "failed"


# -------------------------------------------------- 4. documented values


def test_truncation_auto_drops_the_oldest_items(srv: Server, capture: Capture) -> None:
    client = capture.client(srv.base_url)
    conversation: Any = [{"role": "user", "content": f"turn {i}: " + "hello world " * 20} for i in range(40)]
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="tiny", input=conversation, max_output_tokens=4)
    assert err.value.body["code"] == "context_length_exceeded"  # type: ignore[index]
    fitted = client.responses.create(model="tiny", input=conversation, truncation="auto", max_output_tokens=64,
                                     instructions="Answer briefly.")
    assert fitted.truncation == "auto" and fitted.usage is not None
    assert 4096 // 2 < fitted.usage.input_tokens <= 4096 - 64
    # Streamed too, and the instructions stay.
    events = list(client.responses.create(model="tiny", input=conversation, truncation="auto", max_output_tokens=64,
                                          instructions="Answer briefly.", stream=True))
    final = events[-1]
    assert final.type in ("response.completed", "response.incomplete")
    assert final.response.usage is not None and final.response.usage.input_tokens == fitted.usage.input_tokens


def test_reasoning_effort_max_is_the_templates_highest(srv: Server, capture: Capture) -> None:
    client = capture.client(srv.base_url)

    def prompt_tokens(effort: Any) -> int:
        made = client.responses.create(model="gpt-oss", input="x", reasoning={"effort": effort}, max_output_tokens=1)
        assert made.reasoning is not None and made.reasoning.effort == effort and made.usage is not None
        chat = client.chat.completions.create(model="gpt-oss", messages=[{"role": "user", "content": "x"}],
                                              reasoning_effort=effort, max_tokens=1)
        assert chat.usage is not None
        return made.usage.input_tokens * 1000 + chat.usage.prompt_tokens

    # gpt-oss renders "Reasoning: high": the same prompt for both, another for medium.
    assert prompt_tokens("max") == prompt_tokens("high") != prompt_tokens("medium")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       reasoning_effort="extreme", max_tokens=1)  # type: ignore[arg-type]


def _check_logprobs(entries: list[Any], top: int) -> None:
    assert entries
    for entry in entries:
        assert entry.logprob <= 0 and entry.bytes is not None and len(entry.top_logprobs) == top
        alternatives = [alt.logprob for alt in entry.top_logprobs]
        assert alternatives == sorted(alternatives, reverse=True)


def test_chat_logprobs_streamed_and_not(srv: Server, capture: Capture) -> None:
    client = capture.client(srv.base_url)
    body: Any = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 8,
                 "extra_body": {"ignore_eos": True}, "logprobs": True, "top_logprobs": 2, "seed": 3}
    whole = client.chat.completions.create(**body)
    entries = whole.choices[0].logprobs.content if whole.choices[0].logprobs else None
    assert entries is not None and whole.usage is not None and len(entries) == whole.usage.completion_tokens
    _check_logprobs(entries, 2)
    streamed = []
    for chunk in client.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            streamed += choice.logprobs.content or [] if choice.logprobs else []
    # The same tokens; the values may differ in the last bits (the second
    # request reuses the cached prompt, computed in another batch).
    assert [e.token for e in streamed] == [e.token for e in entries]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in entries], abs=1e-4)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    assert err.value.body["param"] == "top_logprobs"  # type: ignore[index]


def test_legacy_completion_logprobs_streamed_and_not(srv: Server, capture: Capture) -> None:
    client = capture.client(srv.base_url)
    body: Any = {"model": "tiny", "prompt": "once upon", "max_tokens": 8, "logprobs": 2, "seed": 3,
                 "temperature": 0, "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**body)
    [choice] = whole.choices
    lp = choice.logprobs
    assert lp is not None and lp.tokens and whole.usage is not None
    # Tokens that end inside a UTF-8 character come out merged with the next
    # (the engine reports them once the text is whole): never more entries than tokens.
    assert len(lp.tokens) <= whole.usage.completion_tokens
    assert "".join(lp.tokens) == choice.text
    assert lp.token_logprobs is not None and all(v <= 0 for v in lp.token_logprobs)
    assert lp.top_logprobs is not None and all(len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    streamed: list[str] = []
    offsets: list[int] = []
    for chunk in client.completions.create(**body, stream=True):
        for c in chunk.choices:
            if c.logprobs is not None and c.logprobs.tokens:
                streamed += c.logprobs.tokens
                offsets += c.logprobs.text_offset or []
    assert streamed == lp.tokens and offsets == lp.text_offset
    # With echo, the offsets count the prompt before the completion's text.
    echoed = client.completions.create(**body, echo=True)
    assert echoed.choices[0].text.startswith("once upon")
    assert echoed.choices[0].logprobs is not None and echoed.choices[0].logprobs.text_offset
    assert echoed.choices[0].logprobs.text_offset[0] == len("once upon")
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="x", logprobs=6)
    assert err.value.body["param"] == "logprobs"  # type: ignore[index]


def test_responses_logprobs_streamed_and_not(srv: Server, capture: Capture) -> None:
    client = capture.client(srv.base_url)
    body: Any = {"model": "tiny", "input": "x", "max_output_tokens": 8, "include": ["message.output_text.logprobs"],
                 "top_logprobs": 3, "extra_body": {"ignore_eos": True}}
    made = client.responses.create(**body)
    [message] = made.output
    assert message.type == "message" and made.top_logprobs == 3
    entries = message.content[0].logprobs  # type: ignore[union-attr]
    assert entries is not None and made.usage is not None and len(entries) <= made.usage.output_tokens
    _check_logprobs(entries, 3)
    events = list(client.responses.create(**body, stream=True))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    [done_event] = [e for e in events if e.type == "response.output_text.done"]
    final = events[-1].response  # type: ignore[union-attr]
    done = final.output[0].content[0].logprobs
    assert [lp.token for lp in done_event.logprobs] == [lp.token for lp in done]
    assert streamed and done is not None and [lp.token for lp in streamed] == [lp.token for lp in done]


# ------------------------------------------------ 5. structured outputs


class Forecast(BaseModel):
    city: Literal["Paris", "Oslo"]
    unit: Literal["c", "f"]
    degrees: int
    windy: bool
    note: str


def test_parse_with_a_pydantic_model(srv: Server, capture: Capture) -> None:
    client = capture.client(srv.base_url)
    parsed = 0
    for seed in range(6):
        try:
            chat = client.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "forecast"}],
                                                 response_format=Forecast, max_tokens=400, seed=seed)
        except openai.LengthFinishReasonError:
            continue  # a random model may write a long note; never invalid JSON
        assert chat.choices[0].finish_reason == "stop"
        assert isinstance(chat.choices[0].message.parsed, Forecast)
        parsed += 1
    for _ in range(6):
        raw = client.responses.with_raw_response.parse(model="tiny", input="forecast", text_format=Forecast,
                                                       max_output_tokens=400)
        if raw.http_response.json()["status"] != "completed":
            continue
        assert isinstance(raw.parse().output_parsed, Forecast)
        parsed += 1
    assert parsed >= 2


CUT_FAMILIES = [f for f in FAMILIES if not f.thinks or f.starts_in_reasoning or f.style == "harmony"]


@pytest.mark.parametrize("family", CUT_FAMILIES, ids=[f.name for f in CUT_FAMILIES])
def test_every_cut_of_a_forced_call_parses_without_markup(family: Family) -> None:
    # The model's own call text, cut after every character: never text, and
    # any call is get_weather with the arguments written so far.
    tools = [FunctionTool(name="get_weather", parameters=REAL_WEATHER["function"]["parameters"])]
    args = '{"city": "Oslo", "unit": "c"}'
    for cut in range(1, len(family.call_text) + 1):
        plan = tool_plan([], SamplingParams(), profile_for(family.template), tools=tools, choice="required",
                         parallel=False)
        assert plan.forced_call
        parser, text, pieces = plan.parser(), family.call_text[:cut], []
        for i in range(0, len(text), 3):
            pieces += parser.feed(text[i : i + 3])
        pieces += parser.finish()
        assert not [p for p in pieces if isinstance(p, Text)], (cut, pieces)
        assert all(no_markup(p.text) for p in pieces if isinstance(p, Reasoning)), (cut, pieces)
        [call] = [p for p in pieces if isinstance(p, ToolCall)]
        assert call.name == "get_weather" and args.startswith(call.arguments), (cut, call)
        assert call.arguments == args or not call.complete, (cut, call)
