"""Tool calls and reasoning on ``/v1/chat/completions``.

A scripted pool replays model text through the real route, so parsing (calls
written in "auto" mode, ``<think>`` blocks) is tested exactly and fast; the
real worker then proves forced calls, streaming through the official client's
helper and multi-turn histories end to end.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import httpx
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from supervisor import appkeys
from supervisor.api.openai import add_routes, chat_delta, chat_message
from supervisor.app import error_middleware
from supervisor.config import Config
from supervisor.errors import BadRequest
from supervisor.generation.parse import Reasoning, Text, ToolCall
from supervisor.workers.pool import WorkerPool
from supervisor.workers.replies import Blame, Rejected
from tests.server import Server
from worker.protocol import ChatMessage, Delta, Done, ModelFacts, SamplingParams

WEATHER: Any = {
    "type": "function",
    "function": {
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
    },
}
CLOCK: Any = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    "strict": True}}
ASK: Any = [{"role": "user", "content": "Weather in Oslo?"}]
# The generation prompt opens a think block (DeepSeek-R1 / QwQ style).
THINK_TEMPLATE = "{{ messages }}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"


# ------------------------------------------------------------ pure shapes


def test_chat_message_separates_text_reasoning_and_calls() -> None:
    message = chat_message([Reasoning("hmm"), Text("Checking."), ToolCall("get_time", "{}")])
    assert message["content"] == "Checking." and message["reasoning_content"] == "hmm"
    [call] = message["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_time", "arguments": "{}"}
    only_calls = chat_message([ToolCall("a", "{}"), ToolCall("b", '{"x": 1}')])
    assert only_calls["content"] is None
    assert [c["function"]["name"] for c in only_calls["tool_calls"]] == ["a", "b"]
    assert len({c["id"] for c in only_calls["tool_calls"]}) == 2
    assert chat_message([]) == {"role": "assistant", "content": ""}


def test_chat_delta_numbers_calls() -> None:
    assert chat_delta(Text("hi"), 0) == {"content": "hi"}
    assert chat_delta(Reasoning("so"), 0) == {"reasoning_content": "so"}
    [call] = chat_delta(ToolCall("get_time", "{}"), 2)["tool_calls"]
    assert call["index"] == 2 and call["function"]["arguments"] == "{}"


# ------------------------------------------------------- scripted pool


@dataclass
class ScriptedPool:
    """Replays ``texts`` (then Done) for every generation; keeps what it was asked."""

    texts: list[str] = field(default_factory=list)
    finish: str = "stop"
    template: str | None = None
    asked: list[dict[str, Any]] = field(default_factory=list)
    error: BadRequest | None = None
    delay: float = 0.0  # a slow prefill: seconds before the first output (or the error)

    async def facts(self, model: str) -> ModelFacts:
        return ModelFacts("x.gguf", 2048, 2048, 300, True, False, self.template)

    async def admit(self, model: str, **kwargs: Any) -> AsyncGenerator[Delta | Done, None]:
        return self.generate(model, **kwargs)

    async def generate(self, model: str, **kwargs: Any) -> AsyncGenerator[Delta | Done, None]:
        self.asked.append(kwargs)
        await asyncio.sleep(self.delay)
        if self.error is not None:
            raise self.error
        for text in self.texts:
            yield Delta(0, text, 1)
        yield Done(0, self.finish, 9, len(self.texts))  # type: ignore[arg-type]


@asynccontextmanager
async def serving(pool: ScriptedPool, state_dir: Any, keepalive_s: float = 10.0) -> AsyncIterator[str]:
    """The chat routes over the scripted pool on a real socket; yields the chat URL."""
    app = web.Application(middlewares=[error_middleware])
    app[appkeys.CONFIG] = Config(state_dir=str(state_dir), max_body_bytes=1 << 20, responses_keepalive_s=keepalive_s)
    app[appkeys.POOL] = cast(WorkerPool, pool)
    add_routes(app)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("/v1/chat/completions"))
    finally:
        await server.close()


@pytest.fixture
async def scripted(tmp_path: Any) -> AsyncIterator[tuple[ScriptedPool, str]]:
    pool = ScriptedPool()
    async with serving(pool, tmp_path) as url:
        yield pool, url


async def post(url: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as client:
        return await client.post(url, json={"model": "m", "messages": ASK, **body})


async def stream_chunks(url: str, body: dict[str, Any]) -> list[ChatCompletionChunk]:
    chunks = []
    body = {"model": "m", "messages": ASK, "stream": True, **body}
    async with httpx.AsyncClient(timeout=10) as client, client.stream("POST", url, json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(ChatCompletionChunk.model_validate_json(line[6:]))
    return chunks


async def test_a_long_prefill_streams_keepalives_until_the_first_token(tmp_path: Any) -> None:
    # A proxy's read timeout would cut a silent stream: past the keepalive
    # interval the 200 is committed and comments flow until the model speaks.
    pool = ScriptedPool(texts=["Hel", "lo"], delay=0.4)
    body = {"model": "m", "messages": ASK, "stream": True}
    async with serving(pool, tmp_path, keepalive_s=0.05) as url, httpx.AsyncClient(timeout=10) as client:
        r = await client.post(url, json=body)
        assert r.status_code == 200
        assert r.text.index(": keepalive") < r.text.index("data: ")
        chunks = [ChatCompletionChunk.model_validate_json(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        assert accumulate(chunks).choices[0].message.content == "Hello"
        # A rejection after that point can only be the stream's error object.
        pool.error = Rejected("the prompt is too long", code="context_length_exceeded", cause=Blame.PROMPT)
        r = await client.post(url, json=body)
        assert r.status_code == 200 and ": keepalive" in r.text
        assert '"code":"context_length_exceeded"' in r.text
        # A quick rejection is still an HTTP error.
        pool.delay = 0.0
        r = await client.post(url, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def accumulate(chunks: list[ChatCompletionChunk]) -> ChatCompletion:
    state: ChatCompletionStreamState = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(chunk)
    return state.get_final_completion()


AUTO_CALL = ["Let me ", "look. <tool", '_call>{"name": "get_weather", "arguments": ',
             '{"city": "Oslo", "unit": "c"}}</tool_call>']


async def test_auto_call_in_the_text_is_parsed(scripted: tuple[ScriptedPool, str]) -> None:
    pool, url = scripted
    pool.texts = AUTO_CALL
    r = await post(url, {"tools": [WEATHER]})
    assert r.status_code == 200, r.text
    reply = ChatCompletion.model_validate(r.json())
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look. "
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo", "unit": "c"}
    # The template saw the tools in chat form; no grammar for "auto".
    asked = pool.asked[0]
    assert asked["tools"][0]["function"]["name"] == "get_weather"
    assert asked["params"].grammar is None


async def test_streamed_auto_call_accumulates_in_the_client(scripted: tuple[ScriptedPool, str]) -> None:
    pool, url = scripted
    pool.texts = AUTO_CALL
    chunks = await stream_chunks(url, {"tools": [WEATHER]})
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == "Let me look. "  # no part of the call leaked as text
    final = accumulate(chunks).choices[0]
    assert final.finish_reason == "tool_calls"
    [call] = final.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo", "unit": "c"}


async def test_one_call_at_most_without_parallel_calls(scripted: tuple[ScriptedPool, str]) -> None:
    pool, url = scripted
    pool.texts = ['<tool_call>{"name": "get_time", "arguments": {}}']  # cut by the stop string
    r = await post(url, {"tools": [CLOCK], "parallel_tool_calls": False, "stop": ["END"]})
    assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_time"
    assert pool.asked[0]["params"].stop == ["END", "</tool_call>"]


async def test_unknown_names_and_plain_text_stay_text(scripted: tuple[ScriptedPool, str]) -> None:
    pool, url = scripted
    pool.texts = ['<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>']
    r = await post(url, {"tools": [CLOCK]})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == pool.texts[0]
    # Without tools (and a template that does not think) the text passes verbatim.
    pool.texts = [" <tool_call>", "x"]
    r = await post(url, {})
    assert r.json()["choices"][0]["message"]["content"] == " <tool_call>x"


async def test_tool_choice_none_offers_no_tools(scripted: tuple[ScriptedPool, str]) -> None:
    pool, url = scripted
    pool.texts = ['<tool_call>{"name": "get_time", "arguments": {}}</tool_call>']
    r = await post(url, {"tools": [CLOCK], "tool_choice": "none"})
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == pool.texts[0] and "tool_calls" not in choice["message"]
    assert pool.asked[0]["tools"] is None and pool.asked[0]["params"].grammar is None


async def test_forced_choices_set_a_grammar(scripted: tuple[ScriptedPool, str]) -> None:
    pool, url = scripted
    pool.texts = ['<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>']
    named = {"type": "function", "function": {"name": "get_time"}}
    r = await post(url, {"tools": [WEATHER, CLOCK], "tool_choice": named,
                         "response_format": {"type": "json_object"}})
    assert r.json()["choices"][0]["finish_reason"] == "tool_calls"
    params: SamplingParams = pool.asked[0]["params"]
    # Only the named tool, and the call replaces the JSON output format.
    assert params.grammar is not None and "get_time" in params.grammar and "get_weather" not in params.grammar
    assert not params.json_object
    await post(url, {"tools": [WEATHER, CLOCK], "tool_choice": "required"})
    grammar = pool.asked[1]["params"].grammar
    assert "get_time" in grammar and "get_weather" in grammar
    chunks = await stream_chunks(url, {"tools": [CLOCK], "tool_choice": "required"})
    # The first chunk carries no content: a forced reply's content is null.
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content is None
    assert accumulate(chunks).choices[0].message.content is None


async def test_a_bad_forced_grammar_blames_tool_choice(scripted: tuple[ScriptedPool, str]) -> None:
    pool, url = scripted
    pool.error = Rejected("grammar failed", code="invalid_grammar", cause=Blame.GRAMMAR)
    r = await post(url, {"tools": [CLOCK], "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = await post(url, {"response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [CLOCK], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [CLOCK], "tool_choice": "any"}, "tool_choice"),
        ({"tools": [CLOCK], "tool_choice": {"type": "custom", "custom": {"name": "x"}}}, "tool_choice.type"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [CLOCK, CLOCK]}, "tools[1].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        ({"messages": [{"role": "tool", "content": "12"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]},
         "messages[0].tool_calls[0].function"),
    ],
)
async def test_bad_tool_fields_are_400s_naming_them(scripted: tuple[ScriptedPool, str], body: dict[str, Any],
                                                   param: str) -> None:
    pool, url = scripted
    r = await post(url, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert pool.asked == []


async def test_history_with_calls_reaches_the_template(scripted: tuple[ScriptedPool, str]) -> None:
    pool, url = scripted
    pool.texts = ["It is 12 degrees."]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Oslo", "unit": "c"}'}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees"}]
    r = await post(url, {"messages": messages, "tools": [WEATHER]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "It is 12 degrees."}
    sent: list[ChatMessage] = pool.asked[0]["messages"]
    assert [m.role for m in sent] == ["user", "assistant", "tool"]
    assert sent[1].content is None and sent[1].tool_calls == [call]
    # The result is named after its call: some templates render the name.
    assert sent[2].tool_call_id == "call_1" and sent[2].name == "get_weather"


async def test_reasoning_goes_to_reasoning_content(scripted: tuple[ScriptedPool, str]) -> None:
    pool, url = scripted
    pool.template = THINK_TEMPLATE
    pool.texts = ["Let me", " think.</th", "ink>\n\nThe answer."]
    r = await post(url, {})
    message = r.json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "The answer.", "reasoning_content": "Let me think."}
    # Counted per delta: the one that closes the block is still reasoning.
    assert r.json()["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}
    chunks = await stream_chunks(url, {"stream_options": {"include_usage": True}})
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert reasoning == "Let me think." and "".join(d.content or "" for d in deltas) == "The answer."
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens_details is not None
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 3


# ------------------------------------------------------------ real worker


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_forced_call_end_to_end(server: Server, client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=server.model, messages=ASK, tools=[WEATHER],
                                           tool_choice="required", parallel_tool_calls=False,
                                           max_tokens=200)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Paris", "Oslo") and args["unit"] in ("c", "f")


def test_streamed_call_matches_the_whole_reply(server: Server, client: openai.OpenAI) -> None:
    kwargs: Any = {"model": server.model, "messages": ASK, "tools": [WEATHER, CLOCK], "temperature": 0,
                   "max_tokens": 200, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    whole = client.chat.completions.create(**kwargs)
    [expected] = whole.choices[0].message.tool_calls or []
    with client.chat.completions.stream(**kwargs) as stream:
        done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls or []
    assert call.function.name == expected.function.name == "get_weather"
    assert call.function.arguments == expected.function.arguments
    # A strict tool: the helper parsed the arguments, as for OpenAI's own.
    assert call.function.parsed_arguments == json.loads(expected.function.arguments)
    assert [e.name for e in done] == ["get_weather"]


def test_follow_up_with_the_call_and_its_result(server: Server, client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model=server.model, messages=ASK, tools=[WEATHER],
                                           tool_choice="required", parallel_tool_calls=False, max_tokens=200)
    [call] = first.choices[0].message.tool_calls or []
    history: Any = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "12 degrees"}]
    final = client.chat.completions.create(model=server.model, messages=history, tools=[WEATHER],
                                           max_tokens=8)
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert final.usage is not None and first.usage is not None
    assert final.usage.prompt_tokens > first.usage.prompt_tokens


def test_unknown_named_function_is_a_400(server: Server, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=server.model, messages=ASK, tools=[WEATHER], max_tokens=8,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert err.value.param == "tool_choice.function.name"


def test_tool_choice_none_answers_in_text(server: Server, client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=server.model, messages=ASK, tools=[WEATHER], tool_choice="none",
                                           max_tokens=12, extra_body={"ignore_eos": True})
    choice = reply.choices[0]
    assert choice.message.tool_calls is None
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason == "length"
