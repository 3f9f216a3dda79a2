"""Tool calls and reasoning with the published chat templates of real models.

The templates (tests/fixtures/templates, see its README) are the models' own:
Qwen 2.5 and 3, Llama 3.1 and 3.2, Mistral Nemo and Small 3.2, gpt-oss
(harmony) and DeepSeek-R1 (distilled onto Qwen). For each one:

- the renderer takes a whole tool-using conversation (system, user, an
  assistant call, its result, an answer, a second question);
- the profile picks the model's own tool-call format and reasoning shape;
- the text the model writes for a call or a reasoned answer, replayed through
  the real routes, becomes calls and reasoning with no markup left in the text;
- a real server with a tiny random model per template, forced by the
  tool-call grammar, answers with a call that parses back on both APIs,
  streamed or not, and takes the call and its result in a second turn.
"""

from __future__ import annotations

import json
import re
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
from supervisor.app import error_middleware
from supervisor.config import Config
from supervisor.db import Database
from supervisor.generation.grammar import ToolStyle
from supervisor.generation.parse import Piece, Reasoning, Text, ToolCall
from supervisor.generation.profile import profile_for
from supervisor.models.demo import write_tiny_gguf
from supervisor.responses import RESPONSES_SCHEMA, setup
from supervisor.responses.models import FunctionTool
from supervisor.responses.runner import tool_plan
from supervisor.workers.pool import WorkerPool
from tests.server import Server, running, short_tempdir
from worker.chat_template import ChatRenderer, TemplateError
from worker.protocol import ChatMessage, Delta, Done, ModelFacts, SamplingParams

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"

# Markup of every family's calls and reasoning: none of it may reach visible text.
MARKUP = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "<|channel|>",
          "<|message|>", "<|call|>", "<|constrain|>", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>",
          "<｜tool▁sep｜>", "<think>", "</think>")

R1_CALL = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
           '{"city": "Oslo", "unit": "c"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')


@dataclass(frozen=True)
class Family:
    """One template and what its model writes."""

    name: str  # the fixture's file name without .jinja, and the model's id
    style: ToolStyle
    thinks: bool = False
    starts_in_reasoning: bool = False
    # How the generation prompt ends (after a user message).
    prompt_end: str = ""
    # The model's text for a call to get_weather(Oslo, c), thinking first when it does
    # (the reasoning is always "The user wants the weather.").
    call_text: str = ""
    # The model's text for a reasoned answer: "weigh it" then "Sunny."; "" if it does not think.
    answer_text: str = ""
    bos: str = "<s>"
    eos: str = "</s>"
    vars: dict[str, Any] = field(default_factory=dict)

    @property
    def template(self) -> str:
        return (TEMPLATES / f"{self.name}.jinja").read_text()


HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}'
FAMILIES = [
    Family("qwen2.5-instruct", "hermes", prompt_end="<|im_start|>assistant\n", call_text=HERMES_CALL,
           bos="", eos="<|im_end|>"),
    Family("qwen3", "hermes", thinks=True, prompt_end="<|im_start|>assistant\n",
           call_text="<think>\nThe user wants the weather.\n</think>\n\n" + HERMES_CALL,
           answer_text="<think>\nweigh it\n</think>\n\nSunny.", bos="", eos="<|im_end|>"),
    Family("llama3.1-instruct", "llama3", prompt_end="<|start_header_id|>assistant<|end_header_id|>\n\n",
           call_text=LLAMA_CALL, bos="<|begin_of_text|>", eos="<|eot_id|>"),
    # Llama may also tag the call as code to run.
    Family("llama3.2-instruct", "llama3", prompt_end="<|start_header_id|>assistant<|end_header_id|>\n\n",
           call_text="<|python_tag|>" + LLAMA_CALL, bos="<|begin_of_text|>", eos="<|eot_id|>"),
    Family("mistral-nemo-instruct", "mistral", prompt_end="[/INST]",
           call_text='[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}, '
                     '"id": "a1b2c3d4e"}]'),
    Family("mistral-small-3.2", "mistral_args", prompt_end="[/INST]",
           call_text='[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "unit": "c"}'),
    Family("gpt-oss", "harmony", thinks=True, prompt_end="<|start|>assistant",
           call_text="<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant"
                     '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                     '{"city": "Oslo", "unit": "c"}<|call|>',
           answer_text="<|channel|>analysis<|message|>weigh it<|end|>"
                       "<|start|>assistant<|channel|>final<|message|>Sunny.<|return|>",
           bos="<|startoftext|>", eos="<|return|>", vars={"reasoning_effort": "low"}),
    Family("deepseek-r1-distill-qwen", "deepseek", thinks=True, starts_in_reasoning=True,
           prompt_end="<｜Assistant｜><think>\n",
           call_text="The user wants the weather.\n</think>\n\n" + R1_CALL,
           answer_text="weigh it\n</think>\n\nSunny.",
           bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>"),
]
THINKERS = [f for f in FAMILIES if f.answer_text]
IDS = [f.name for f in FAMILIES]

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
    },
}
# No description and no parameters: templates must cope with both missing.
CLOCK: Any = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, CLOCK]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
ASK: Any = [{"role": "user", "content": "Weather in Oslo?"}]


def no_markup(text: str | None) -> bool:
    return not any(m in (text or "") for m in MARKUP)


def check_weather_args(arguments: str) -> None:
    args = json.loads(arguments)
    assert set(args) == {"city", "unit"} and args["city"] in ("Paris", "Oslo") and args["unit"] in ("c", "f")


# ------------------------------------------------------------ rendering


def conversation(content_beside_calls: str | None, call_id: str = "call_5f3a9c0e1b2d4a6f") -> list[ChatMessage]:
    """system, user, a call with reasoning, its result, an answer, a second question."""
    call = {"id": call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}
    return [
        ChatMessage("system", "Answer briefly."),
        ChatMessage("user", "Weather in Oslo?"),
        ChatMessage("assistant", content_beside_calls, tool_calls=[call], reasoning_content="Need the tool."),
        ChatMessage("tool", "12 degrees", tool_call_id=call_id, name="get_weather"),
        ChatMessage("assistant", "It is 12 degrees in Oslo."),
        ChatMessage("user", "And in Paris?"),
    ]


def render(family: Family, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None) -> str:
    return ChatRenderer(family.template, family.bos, family.eos).render(messages, tools, family.vars)


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_a_tool_conversation_renders(family: Family) -> None:
    # Chat clients send no content beside calls; the Responses API sends "".
    prompts = [render(family, conversation(content), TOOLS) for content in (None, "")]
    assert prompts[0] == prompts[1]
    prompt = prompts[0]
    assert prompt.endswith(family.prompt_end), prompt[-200:]
    assert not family.bos or not prompt.startswith(family.bos)  # the tokenizer adds BOS itself
    # The call, its result, the answer and both questions are all in the prompt.
    for part in ("Weather in Oslo?", '"city": "Oslo"', "12 degrees", "It is 12 degrees in Oslo.", "And in Paris?"):
        assert part in prompt, (part, prompt)
    # A tool result as the last turn (the model answers it next) renders too.
    assert "12 degrees" in render(family, conversation(None)[:4], TOOLS)


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_plain_turns_render_without_tools(family: Family) -> None:
    messages = [ChatMessage("system", "Answer briefly."), ChatMessage("user", "Hi"),
                ChatMessage("assistant", "Hello."), ChatMessage("user", "Bye")]
    prompt = render(family, messages)
    assert prompt.endswith(family.prompt_end) and "Hello." in prompt and "Bye" in prompt
    assert "get_weather" not in prompt


def by_name(name: str) -> Family:
    return next(f for f in FAMILIES if f.name == name)


@pytest.mark.parametrize(
    ("name", "rendered"),
    [
        ("qwen2.5-instruct", HERMES_CALL),
        ("qwen3", HERMES_CALL),
        ("llama3.1-instruct", "<|start_header_id|>assistant<|end_header_id|>\n\n" + LLAMA_CALL),
        ("llama3.2-instruct", "<|start_header_id|>assistant<|end_header_id|>\n\n" + LLAMA_CALL),
        ("mistral-nemo-instruct", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}'),
        ("mistral-small-3.2", "[TOOL_CALLS]get_weather[CALL_ID]"),
        ("gpt-oss", ("<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
                     '{"city": "Oslo", "unit": "c"}<|call|>')),
        # DeepSeek-R1 renders a call only for a message whose content is none.
        ("deepseek-r1-distill-qwen", ("<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                                      '{"city": "Oslo", "unit": "c"}\n```<｜tool▁call▁end｜>')),
    ],
)
def test_history_calls_are_in_the_models_own_markup(name: str, rendered: str) -> None:
    assert rendered in render(by_name(name), conversation(None), TOOLS)


def test_reasoning_of_the_current_turn_reaches_the_template() -> None:
    # The turn still in progress: the question, the call (with its reasoning), the result.
    qwen3 = render(by_name("qwen3"), conversation(None)[:4], TOOLS)
    assert "<|im_start|>assistant\n<think>\nNeed the tool.\n</think>\n\n<tool_call>" in qwen3
    oss = render(by_name("gpt-oss"), conversation(None)[:4], TOOLS)
    assert "<|start|>assistant<|channel|>analysis<|message|>Need the tool.<|end|>" in oss
    assert "Reasoning: low" in oss


@pytest.mark.parametrize(
    ("name", "call_id", "result_id"),
    [
        ("mistral-nemo-instruct", r'"id": "(\w+)"\}\]', r'"call_id": "(\w+)"'),
        ("mistral-small-3.2", r"\[CALL_ID\](\w+)\[ARGS\]", r"\[TOOL_RESULTS\](\w+)\[TOOL_CONTENT\]"),
    ],
)
def test_mistral_call_ids_become_nine_characters_and_stay_paired(name: str, call_id: str, result_id: str) -> None:
    family = by_name(name)
    first = render(family, conversation(None, "call_5f3a9c0e1b2d4a6f"), TOOLS)
    [made] = re.findall(call_id, first)
    assert len(made) == 9 and re.findall(result_id, first) == [made]
    assert render(family, conversation(None, "call_5f3a9c0e1b2d4a6f"), TOOLS) == first  # stable across turns
    assert render(family, conversation(None, "call_0000000000000000"), TOOLS) != first
    # An id the template accepts already is kept as it is.
    assert "a1B2c3D4e" in render(family, conversation(None, "a1B2c3D4e"), TOOLS)


def test_gpt_oss_keeps_content_beside_a_call_rather_than_refusing_it() -> None:
    # The template refuses a call turn with both content and thinking.
    messages = conversation("Let me check.")[:4]
    prompt = render(by_name("gpt-oss"), messages, TOOLS)
    assert "<|channel|>analysis<|message|>Let me check.<|end|>" in prompt and "Need the tool." not in prompt


def test_loop_controls_and_filters_templates_use() -> None:
    template = (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{{ m.content.split(' ')[0] }}{% if m.content.startswith('stop') %}{% break %}{% endif %}"
        "{% for k, v in {'a': 1} | items %}{{ k }}{{ v }}{% endfor %}{% endfor %}"
        "{{ {'é': 1} | tojson(ensure_ascii=True) }}{{ {'é': 1} | tojson }}"
        "{% set ns = namespace(n=0) %}{% set ns.n = ns.n + 1 %}{{ ns.n }}{{ strftime_now('%Y') | length }}"
        "{{ '[' + missing + ']' }}"
    )
    messages = [ChatMessage("system", "skip me"), ChatMessage("user", "hello there"),
                ChatMessage("user", "stop now"), ChatMessage("user", "never")]
    out = ChatRenderer(template, "", "").render(messages)
    assert out == 'helloa1stop{"\\u00e9": 1}{"é": 1}14[]'


def test_python_errors_inside_a_template_are_template_errors() -> None:
    renderer = ChatRenderer("{{ messages[0].content + none }}", "", "")
    with pytest.raises(TemplateError, match="chat template failed"):
        renderer.render([ChatMessage("user", "hi")])


# ------------------------------------------------------------- profiles


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_profile_reads_the_family(family: Family) -> None:
    profile = profile_for(family.template)
    assert profile.tool_style == family.style
    assert profile.thinks == family.thinks
    assert profile.starts_in_reasoning == family.starts_in_reasoning
    assert profile.harmony == (family.style == "harmony")


def test_reasoning_controls() -> None:
    assert profile_for(by_name("qwen3").template).template_vars("none") == {"enable_thinking": False}
    assert profile_for(by_name("gpt-oss").template).template_vars("high") == {"reasoning_effort": "high"}
    assert profile_for(by_name("qwen2.5-instruct").template).template_vars("high") == {}


# ------------------------------------------- the model's own text, parsed

FUNCTIONS = [FunctionTool(name="get_weather", parameters=WEATHER["function"]["parameters"]),
             FunctionTool(name="get_time")]


def parse(family: Family, text: str, step: int, tools: bool = True) -> list[Piece]:
    """What a reply parses into when ``text`` arrives ``step`` characters at a time."""
    plan = tool_plan([], SamplingParams(), profile_for(family.template), tools=FUNCTIONS if tools else [],
                     choice="auto", parallel=True)
    parser = plan.parser()
    out: list[Piece] = []
    for i in range(0, len(text), step):
        out += parser.feed(text[i : i + step])
    out += parser.finish()
    # Joined: how the text was cut must not matter.
    merged: list[Piece] = []
    for piece in out:
        last = merged[-1] if merged else None
        if isinstance(piece, Text) and isinstance(last, Text):
            merged[-1] = Text(last.text + piece.text)
        elif isinstance(piece, Reasoning) and isinstance(last, Reasoning):
            merged[-1] = Reasoning(last.text + piece.text)
        else:
            merged.append(piece)
    return merged


def stripped(piece: Piece) -> Piece:
    """Text and reasoning without the blank lines around them (templates differ there)."""
    if isinstance(piece, Text):
        return Text(piece.text.strip())
    if isinstance(piece, Reasoning):
        return Reasoning(piece.text.strip())
    return piece


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_the_models_call_text_parses(family: Family, step: int) -> None:
    *before, call = parse(family, family.call_text, step)
    assert call == ToolCall("get_weather", '{"city": "Oslo", "unit": "c"}')
    expected = [Reasoning("The user wants the weather.")] if family.thinks else []
    assert [stripped(p) for p in before] == expected


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize("family", THINKERS, ids=[f.name for f in THINKERS])
def test_the_models_reasoned_answer_splits(family: Family, step: int) -> None:
    for tools in (False, True):
        pieces = parse(family, family.answer_text, step, tools=tools)
        assert [stripped(p) for p in pieces] == [Reasoning("weigh it"), Text("Sunny.")]


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_a_call_to_an_unknown_tool_is_not_a_call(family: Family) -> None:
    text = family.call_text.replace("get_weather", "rm_rf")
    assert not any(isinstance(p, ToolCall) for p in parse(family, text, 1000))


@pytest.mark.parametrize("step", [1, 1000])
def test_harmony_edge_cases(step: int) -> None:
    oss = by_name("gpt-oss")
    # A preamble on the commentary channel is shown; the recipient may come before the channel.
    text = ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.get_time"
            "<|channel|>commentary json<|message|>{}<|call|>")
    assert parse(oss, text, step) == [Text("Checking."), ToolCall("get_time", "{}")]
    # Text that ignores the format is an answer; a cut header is dropped.
    assert parse(oss, "Just words <b>.", step) == [Text("Just words <b>.")]
    assert parse(oss, "<|channel|>analysis<|message|>hmm<|end|><|start|>assistant<|chan", step) == [Reasoning("hmm")]
    # Arguments cut by the token limit are an incomplete call, never text.
    cut = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Os'
    assert parse(oss, cut, step) == [ToolCall("get_weather", '{"city": "Os', complete=False)]


def test_deepseek_variants() -> None:
    r1 = by_name("deepseek-r1-distill-qwen")
    two = ("done</think>" + R1_CALL.replace("<｜tool▁calls▁end｜>", "\n") + R1_CALL.removeprefix(
        "<｜tool▁calls▁begin｜>").replace("Oslo", "Paris"))
    assert parse(r1, two, 1000) == [Reasoning("done"), ToolCall("get_weather", '{"city": "Oslo", "unit": "c"}'),
                                    ToolCall("get_weather", '{"city": "Paris", "unit": "c"}')]
    # DeepSeek V3.1 writes name<｜tool▁sep｜>arguments, without the fence.
    v31 = "x</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    assert parse(r1, v31, 1000) == [Reasoning("x"), ToolCall("get_time", "{}")]


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
