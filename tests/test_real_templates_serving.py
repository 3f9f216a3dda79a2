"""Real chat templates served: the models' own call and reasoning text
replayed through the real routes, and a real server with a tiny random
model per template whose forced calls parse back (see test_real_templates.py
for the families)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import httpx
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from supervisor import appkeys
from supervisor.api.openai import add_routes
from supervisor.api.responses import setup
from supervisor.app import error_middleware
from supervisor.config import Config
from supervisor.db import Database
from supervisor.models.demo import write_tiny_gguf
from supervisor.responses import RESPONSES_SCHEMA
from supervisor.workers.pool import WorkerPool
from tests.real_templates import (
    ASK,
    FAMILIES,
    IDS,
    RESPONSES_TOOLS,
    THINKERS,
    TOOLS,
    WEATHER,
    Family,
    check_weather_args,
    no_markup,
)
from tests.responses_fake import NoModels
from tests.server import Server, running, short_tempdir
from worker.protocol import Delta, Done, ModelFacts

# ------------------------------------------- replayed through the real routes


class ReplayOutputs:
    """One generation replaying fixed text, then Done."""

    def __init__(self, texts: list[str]) -> None:
        self._steps: list[Delta | Done] = [Delta(0, t, 1) for t in texts]
        self._steps.append(Done(0, "stop", 9, len(texts)))

    def __aiter__(self) -> ReplayOutputs:
        return self

    async def __anext__(self) -> Delta | Done:
        if not self._steps:
            raise StopAsyncIteration
        return self._steps.pop(0)

    async def accepted(self) -> None:
        return None

    async def aclose(self) -> None:
        self._steps = []


@dataclass
class Replay:
    """A pool whose model is ``template`` and always writes ``texts``."""

    template: str = ""
    texts: list[str] = field(default_factory=list)
    # The routes look a model up before a load (an hf model's images): none here.
    models: NoModels = field(default_factory=NoModels)

    async def facts(self, model: str) -> ModelFacts:
        return ModelFacts("x.gguf", 8192, 8192, 300, True, False, self.template)

    async def admit(self, model: str, **kwargs: Any) -> ReplayOutputs:
        return ReplayOutputs(self.texts)


@pytest.fixture
async def replay(tmp_path: Path) -> AsyncIterator[tuple[Replay, str]]:
    """Chat completions and the Responses API over a replaying pool; yields the base URL."""
    pool = Replay()
    app = web.Application(middlewares=[error_middleware])
    app[appkeys.CONFIG] = Config(state_dir=str(tmp_path), max_body_bytes=1 << 20)

    async def resources(app: web.Application) -> AsyncIterator[None]:
        db = Database(tmp_path / "gv.db", [RESPONSES_SCHEMA])
        await db.open()
        app[appkeys.DB] = db
        app[appkeys.POOL] = cast(WorkerPool, pool)
        yield
        await db.close()

    app.cleanup_ctx.append(resources)
    add_routes(app)
    setup(app)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield pool, f"http://127.0.0.1:{server.port}"
    finally:
        await server.close()


def chunked(text: str, size: int = 3) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@dataclass
class Reply:
    """What a client got, whichever API and mode."""

    text: str
    reasoning: str
    calls: list[tuple[str, str]]  # name, arguments
    finish: str  # the chat finish_reason, or the response's status


async def sse_lines(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> list[str]:
    async with client.stream("POST", url, json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        return [line[6:] async for line in r.aiter_lines() if line.startswith("data: ") and line != "data: [DONE]"]


async def chat(base: str, body: dict[str, Any], stream: bool) -> Reply:
    url = base + "/v1/chat/completions"
    async with httpx.AsyncClient(timeout=60) as client:
        if stream:
            state: ChatCompletionStreamState = ChatCompletionStreamState()
            deltas = []
            for line in await sse_lines(client, url, body):
                chunk = ChatCompletionChunk.model_validate_json(line)
                state.handle_chunk(chunk)
                deltas += [c.delta for c in chunk.choices]
            # The snapshot, not the final completion: that one refuses a reply cut by the token limit.
            choice: Any = state.current_completion_snapshot.choices[0]
            # Streamed content is what the client showed: it must be clean too.
            assert "".join(d.content or "" for d in deltas) == (choice.message.content or "")
            reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        else:
            r = await client.post(url, json=body)
            assert r.status_code == 200, r.text
            choice = ChatCompletion.model_validate(r.json()).choices[0]
            reasoning = r.json()["choices"][0]["message"].get("reasoning_content") or ""
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    return Reply(choice.message.content or "", reasoning, calls, choice.finish_reason)


async def responses(base: str, body: dict[str, Any], stream: bool) -> Reply:
    url = base + "/v1/responses"
    async with httpx.AsyncClient(timeout=60) as client:
        if stream:
            events = [json.loads(line) for line in await sse_lines(client, url, body)]
            assert events[-1]["type"] in ("response.completed", "response.incomplete")
            response = events[-1]["response"]
            streamed = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
            assert no_markup(streamed)
            # Each call streams its arguments whole, then is done under its name.
            done = [(e["name"], e["arguments"]) for e in events if e["type"] == "response.function_call_arguments.done"]
        else:
            r = await client.post(url, json=body)
            assert r.status_code == 200, r.text
            response = r.json()
    output = response["output"]
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    reasoning = "".join(part["text"] for item in output if item["type"] == "reasoning" for part in item["content"])
    calls = [(item["name"], item["arguments"]) for item in output if item["type"] == "function_call"]
    if stream:
        assert done == calls
    return Reply(text, reasoning, calls, response["status"])


async def ask(base: str, api: str, stream: bool, *, model: str = "m", max_tokens: int = 400,
              **fields: Any) -> Reply:
    """Ask "Weather in Oslo?" on ``api``; ``fields`` in chat-completions form."""
    if api == "chat":
        return await chat(base, {"model": model, "messages": ASK, "max_tokens": max_tokens, **fields}, stream)
    if "tools" in fields:
        fields["tools"] = [{"type": "function", **t["function"]} for t in fields["tools"]]
    choice = fields.get("tool_choice")
    if isinstance(choice, dict):
        fields["tool_choice"] = {"type": "function", "name": choice["function"]["name"]}
    body = {"model": model, "input": "Weather in Oslo?", "max_output_tokens": max_tokens, **fields}
    return await responses(base, body, stream)


APIS = [("chat", False), ("chat", True), ("responses", False), ("responses", True)]
API_IDS = ["chat", "chat-stream", "responses", "responses-stream"]


@pytest.mark.parametrize(("api", "stream"), APIS, ids=API_IDS)
@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
async def test_replayed_call_is_a_call_on_every_api(replay: tuple[Replay, str], family: Family, api: str,
                                                    stream: bool) -> None:
    pool, base = replay
    pool.template, pool.texts = family.template, chunked(family.call_text)
    reply = await ask(base, api, stream, tools=TOOLS)
    assert reply.calls == [("get_weather", '{"city": "Oslo", "unit": "c"}')]
    assert reply.text.strip() == "" and no_markup(reply.reasoning)
    assert reply.reasoning.strip() == ("The user wants the weather." if family.thinks else "")


@pytest.mark.parametrize(("api", "stream"), APIS, ids=API_IDS)
@pytest.mark.parametrize("family", THINKERS, ids=[f.name for f in THINKERS])
async def test_replayed_reasoning_is_split_on_every_api(replay: tuple[Replay, str], family: Family, api: str,
                                                        stream: bool) -> None:
    pool, base = replay
    pool.template, pool.texts = family.template, chunked(family.answer_text)
    reply = await ask(base, api, stream)
    assert (reply.reasoning.strip(), reply.text.strip()) == ("weigh it", "Sunny.")
    assert reply.calls == []


# --------------------------------------------------------- a real server


@pytest.fixture(scope="module")
def real() -> Iterator[Server]:
    """One server, one tiny random model per template."""
    models = short_tempdir("gvr")
    for family in FAMILIES:
        write_tiny_gguf(models / f"{family.name}.gguf", chat_template=family.template, n_ctx=8192)
    env = {
        # Long enough for the longest prompt: Mistral Small's own system prompt plus the tools.
        "GPUVISOR_N_CTX": "8192",
        "GPUVISOR_MAX_LOADED_MODELS": str(len(FAMILIES)),
        "GPUVISOR_PARALLEL": "1",
    }
    with running(Server(models, env=env)) as srv:
        yield srv


def real_client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


CHOICES = ["required", {"type": "function", "function": {"name": "get_weather"}}]


@pytest.mark.parametrize("choice", CHOICES, ids=["required", "named"])
@pytest.mark.parametrize(("api", "stream"), APIS, ids=API_IDS)
@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
async def test_forced_call_parses_back(real: Server, family: Family, api: str, stream: bool, choice: Any) -> None:
    # "required" with one tool, or that tool named among several.
    tools = [WEATHER] if choice == "required" else TOOLS
    reply = await ask(real.base_url, api, stream, model=family.name, tools=tools, tool_choice=choice,
                      parallel_tool_calls=False)
    assert reply.finish in ("tool_calls", "completed")
    [(name, arguments)] = reply.calls
    assert name == "get_weather"
    check_weather_args(arguments)
    assert reply.text == "" and no_markup(reply.reasoning)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.style not in ("llama3", "harmony")],
                         ids=[f.name for f in FAMILIES if f.style not in ("llama3", "harmony")])
async def test_parallel_forced_calls_all_parse(real: Server, family: Family) -> None:
    reply = await ask(real.base_url, "chat", False, model=family.name, tools=TOOLS, tool_choice="required",
                      max_tokens=3000, seed=7)
    assert reply.finish == "tool_calls" and reply.text == ""
    assert 1 <= len(reply.calls) <= 8
    for name, arguments in reply.calls:
        if name == "get_weather":
            check_weather_args(arguments)
        else:
            assert (name, json.loads(arguments)) == ("get_time", {})


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_second_turn_with_the_call_and_its_result(real: Server, family: Family) -> None:
    client = real_client(real)
    opening: Any = [{"role": "system", "content": "Answer briefly."}, *ASK]
    first = client.chat.completions.create(model=family.name, messages=opening, tools=TOOLS,
                                           tool_choice="required", parallel_tool_calls=False, max_tokens=400)
    [call] = first.choices[0].message.tool_calls or []
    history: Any = [*opening, first.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "12 degrees"}]
    final = client.chat.completions.create(model=family.name, messages=history, tools=TOOLS, max_tokens=8)
    assert final.usage is not None and first.usage is not None
    assert final.usage.prompt_tokens > first.usage.prompt_tokens
    assert no_markup(final.choices[0].message.content)

    tools: Any = RESPONSES_TOOLS
    made = client.responses.create(model=family.name, input="Weather in Oslo?", tools=tools, tool_choice="required",
                                   parallel_tool_calls=False, max_output_tokens=400)
    [item] = [o for o in made.output if o.type == "function_call"]
    after = client.responses.create(
        model=family.name, previous_response_id=made.id, tools=tools, max_output_tokens=8,
        input=[{"type": "function_call_output", "call_id": item.call_id, "output": "12 degrees"}])
    assert after.status in ("completed", "incomplete"), after.error
    assert after.usage is not None and made.usage is not None
    assert after.usage.input_tokens > made.usage.input_tokens


@pytest.mark.parametrize(("api", "stream"), APIS, ids=API_IDS)
async def test_r1_thinks_in_the_block_its_template_opens(real: Server, api: str, stream: bool) -> None:
    # The random model never closes the block: all of its text is reasoning.
    reply = await ask(real.base_url, api, stream, model="deepseek-r1-distill-qwen", max_tokens=12, ignore_eos=True)
    assert reply.finish in ("length", "incomplete")
    assert reply.reasoning and reply.text == "" and reply.calls == []
