"""Tools on a model whose chat template has no tool support: llama.cpp's
generic format (supervisor/generation/generic_calls.py).

The tools go in the system prompt, a grammar holds the output to a JSON call
or answer, and the parser turns it back into calls or text. Pure parts are
checked directly (profile, prompt, history, parser fed in every split); a
real server with tiny random models (a plain ChatML template, and no
template at all) then answers the official client on both APIs: the prompt
it tokenized is the one with the tools, forced calls validate against their
schemas, "auto" answers or calls, and streamed equals whole.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionMessage, ChatCompletionMessageFunctionToolCall

from supervisor.generation.generic_calls import offer_in_prompt, portable_history
from supervisor.generation.generic_parse import GenericParser
from supervisor.generation.pieces import Piece, Text, ToolCall
from supervisor.generation.profile import file_tool_format, profile_for, served_profile
from supervisor.generation.tools import FunctionTool, NamedFunction
from supervisor.models.demo import CHATML_TEMPLATE, write_tiny_gguf
from supervisor.responses.runner import tool_plan
from tests.real_templates import by_name
from tests.server import Server, running, short_tempdir
from worker.chat_template import ChatRenderer, TemplateError
from worker.protocol import ChatMessage, ModelFacts, SamplingParams

# A Hermes-style template that lists the tools itself (native).
NATIVE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% for tool in tools %}{{ tool | tojson }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Gemma 2's rules: no system role, turns alternate user/assistant.
GEMMA_LIKE = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{{ message['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

BOOK: Any = {
    "type": "function",
    "function": {
        "name": "book_table",
        "description": "Book a table at a restaurant",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo"]},
                "guests": {"type": "integer"},
                "terrace": {"type": "boolean"},
                "time": {"type": "object", "properties": {"day": {"type": "string", "enum": ["mon", "tue"]},
                                                          "hour": {"type": "integer"}},
                         "required": ["day", "hour"], "additionalProperties": False},
                "diet": {"anyOf": [{"type": "string", "enum": ["vegan", "fish"]}, {"type": "null"}]},
            },
            "required": ["city", "guests", "terrace", "time"],
            "additionalProperties": False,
        },
    },
}
CLOCK: Any = {"type": "function", "function": {
    "name": "get_time", "description": "The time now",
    "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}
TOOLS = [BOOK, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "A table in Oslo?"}]


def functions(tools: list[Any] = TOOLS) -> list[FunctionTool]:
    return [FunctionTool(name=t["function"]["name"], description=t["function"].get("description"),
                         parameters=t["function"].get("parameters")) for t in tools]


def asked() -> list[ChatMessage]:
    return [ChatMessage(m["role"], m["content"]) for m in ASK]


def function_calls(message: ChatCompletionMessage) -> list[ChatCompletionMessageFunctionToolCall]:
    """The message's tool calls, each a function call."""
    calls = message.tool_calls or []
    assert all(isinstance(c, ChatCompletionMessageFunctionToolCall) for c in calls)
    return [c for c in calls if isinstance(c, ChatCompletionMessageFunctionToolCall)]


def check_call(name: str, arguments: str) -> dict[str, Any]:
    """The arguments of a call to ``name``, validated against its schema."""
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return dict(args)


# ------------------------------------------------------------ which format


def test_the_profile_names_the_format() -> None:
    assert profile_for(CHATML_TEMPLATE).tool_format == "generic"
    assert profile_for(GEMMA_LIKE).tool_format == "generic" and not profile_for(GEMMA_LIKE).system_role
    assert profile_for(NATIVE_TEMPLATE).tool_format == "native-hermes"
    for name, fmt in [("qwen2.5-instruct", "native-hermes"), ("llama3.1-instruct", "native-llama3"),
                      ("mistral-small-3.2", "native-mistral_args"), ("gpt-oss", "native-harmony")]:
        assert profile_for(by_name(name).template).tool_format == fmt
    # DeepSeek-R1 has call markup but lists no tools: its format, and the tools in the prompt.
    r1 = profile_for(by_name("deepseek-r1-distill-qwen").template)
    assert r1.tool_format == "native-deepseek" and r1.tool_support == "unlisted"
    # A file without a template is prompted in ChatML, which has no tools.
    assert file_tool_format(None) == "generic"
    facts = ModelFacts("m.gguf", 512, 512, 300, False, False, None)
    assert served_profile(facts).tool_format == "generic"


# ------------------------------------------------------------ the prompt


def plan_for(template: str, choice: Any = "auto", *, parallel: bool = True, messages: list[ChatMessage] | None = None,
             params: SamplingParams | None = None) -> Any:
    return tool_plan(messages or asked(), params or SamplingParams(), profile_for(template),
                     tools=functions(), choice=choice, parallel=parallel)


def render(template: str, plan: Any) -> str:
    return ChatRenderer(template, "<s>", "</s>").render(plan.messages, plan.tools)


def test_the_tools_join_the_system_message() -> None:
    plan = plan_for(CHATML_TEMPLATE)
    assert plan.tools is None  # the template could not use them
    [system, user] = plan.messages
    assert system.role == "system" and system.content is not None
    assert system.content.startswith("Be brief.\n\n")
    for part in ('"name": "book_table"', '"enum": ["mon", "tue"]', "The time now", '{"tool_call": ',
                 '{"response": '):
        assert part in system.content, part
    assert user.content == "A table in Oslo?"
    assert "book_table" in render(CHATML_TEMPLATE, plan)
    # No system message: a new one comes first.
    alone = plan_for(CHATML_TEMPLATE, messages=[ChatMessage("user", "hi")])
    assert [m.role for m in alone.messages] == ["system", "user"]


def test_a_template_without_a_system_role_gets_them_in_the_first_user_turn() -> None:
    messages = [ChatMessage("user", "A table in Oslo?")]
    plan = plan_for(GEMMA_LIKE, messages=messages)
    [user] = plan.messages
    assert user.content is not None and user.content.endswith("\n\nA table in Oslo?")
    prompt = render(GEMMA_LIKE, plan)
    assert prompt.startswith("<start_of_turn>user\nYou can call") and "book_table" in prompt


def test_each_choice_has_its_grammar_and_words() -> None:
    auto = plan_for(CHATML_TEMPLATE)
    assert auto.params.grammar is not None and "answer" in auto.params.grammar and not auto.forced_call
    required = plan_for(CHATML_TEMPLATE, "required", parallel=False)
    grammar = required.params.grammar
    assert grammar is not None and "answer" not in grammar and "some-calls" not in grammar
    assert "book_table" in grammar and "get_time" in grammar and required.forced_call
    assert "You must call a tool." in (required.messages[0].content or "")
    named = plan_for(CHATML_TEMPLATE, NamedFunction("get_time"))
    assert named.params.grammar is not None and "book_table" not in named.params.grammar
    assert named.forced_name == "get_time"
    # "none": nothing offered, nothing held.
    none = plan_for(CHATML_TEMPLATE, "none")
    assert none.params.grammar is None and none.messages == asked() and none.tools is None


def test_an_output_format_becomes_the_answers_format() -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    plan = plan_for(CHATML_TEMPLATE, params=SamplingParams(json_schema=json.dumps(schema)))
    assert plan.params.json_schema is None and not plan.json_output
    assert '"{\\"response\\": " answer-value' in (plan.params.grammar or "")


def test_the_history_renders_where_the_template_knows_no_calls() -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_time", "arguments": "{}"}}
    other = {"id": "call_2", "type": "function",
             "function": {"name": "book_table", "arguments": '{"city": "Oslo"}'}}
    history = [ChatMessage("user", "Time, and a table?"),
               ChatMessage("assistant", None, tool_calls=[call, other]),
               ChatMessage("tool", "12:00", tool_call_id="call_1", name="get_time"),
               ChatMessage("tool", "booked", tool_call_id="call_2", name="book_table"),
               ChatMessage("assistant", "Done.")]
    portable = portable_history(history)
    assert [m.role for m in portable] == ["user", "assistant", "user", "assistant"]
    assert json.loads(portable[1].content or "") == {"tool_calls": [
        {"name": "get_time", "arguments": {}}, {"name": "book_table", "arguments": {"city": "Oslo"}}]}
    results = [json.loads(line) for line in (portable[2].content or "").splitlines()]
    assert results == [{"tool_response": {"name": "get_time", "content": "12:00"}},
                       {"tool_response": {"name": "book_table", "content": "booked"}}]
    # The alternating template refuses the raw history and takes the portable one.
    with pytest.raises(TemplateError):
        ChatRenderer(GEMMA_LIKE, "", "").render(history)
    plan = plan_for(GEMMA_LIKE, messages=history)
    assert '"tool_response"' in render(GEMMA_LIKE, plan)


def test_a_template_that_lists_no_tools_keeps_its_own_call_format() -> None:
    r1 = by_name("deepseek-r1-distill-qwen")
    plan = plan_for(r1.template, "required")
    assert plan.messages[0].role == "system" and '"name": "book_table"' in (plan.messages[0].content or "")
    assert plan.params.grammar is not None and "tool▁calls▁begin" in plan.params.grammar
    assert "tool_call\\\"" not in plan.params.grammar and "Reply with one JSON" not in (plan.messages[0].content or "")


def test_native_templates_are_unchanged() -> None:
    plan = plan_for(NATIVE_TEMPLATE)
    assert plan.messages == asked() and plan.params.grammar is None and plan.tools is not None


# ------------------------------------------------------------ the parser


def parse_in_steps(text: str, step: int, names: frozenset[str] = frozenset({"book_table", "get_time"}),
                   **kwargs: Any) -> list[Piece]:
    parser = GenericParser(names, **kwargs)
    pieces: list[Piece] = []
    for i in range(0, len(text), step):
        pieces += parser.feed(text[i : i + step])
    pieces += parser.finish()
    return pieces


def joined(pieces: list[Piece]) -> list[Piece]:
    """Consecutive text pieces as one (streams split text anywhere)."""
    out: list[Piece] = []
    for p in pieces:
        if isinstance(p, Text) and out and isinstance(out[-1], Text):
            out[-1] = Text(out[-1].text + p.text)
        else:
            out.append(p)
    return out


ANSWER = '{"response": "Caf\\u00e9 \\"Nord\\"\\nat 8 \\ud83d\\ude00."}'
CASES: list[tuple[str, list[Piece]]] = [
    ('{"tool_call": {"name": "get_time", "arguments": {}}}', [ToolCall("get_time", "{}")]),
    ('{"tool_calls": [{"name": "get_time", "arguments": {}}, {"name": "book_table", "arguments": {"city": "Oslo"}}]}',
     [ToolCall("get_time", "{}"), ToolCall("book_table", '{"city": "Oslo"}')]),
    (ANSWER, [Text('Café "Nord"\nat 8 \U0001f600.')]),
    ('{"response": {"ok": true}}', [Text('{"ok": true}')]),
    ('{"response": ""}', []),
    # Cut by the token limit inside a call, and inside the answer's escape.
    ('{"tool_call": {"name": "book_table", "arguments": {"city": "Os',
     [ToolCall("book_table", '{"city": "Os', complete=False)]),
    ('{"response": "half \\u00', [Text("half ")]),
    # Not the format (no grammar held it): text as written.
    ("plain words", [Text("plain words")]),
    ('{"tool_call": {"name": "rm_rf", "arguments": {}}}', [Text('{"tool_call": {"name": "rm_rf", "arguments": {}}}')]),
]


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize(("text", "expected"), CASES, ids=[c[0][:30] for c in CASES])
def test_the_output_parses_in_any_split(text: str, expected: list[Piece], step: int) -> None:
    assert joined(parse_in_steps(text, step)) == expected


def test_the_answer_streams_before_the_output_ends() -> None:
    parser = GenericParser(frozenset({"get_time"}))
    assert parser.feed('{"response": "Hel') == [Text("Hel")]
    assert parser.feed('lo\\') == [Text("lo")]  # a cut escape waits for the next delta
    assert parser.feed('n"}') == [Text("\n")]
    assert parser.finish() == []


def test_a_think_block_closed_by_the_grammar_is_not_text() -> None:
    text = '</think>\n\n{"tool_call": {"name": "get_time", "arguments": {}}}'
    for step in (1, 4, 100):
        assert parse_in_steps(text, step, after_think=True, forced=True) == [ToolCall("get_time", "{}")]


# ------------------------------------------------------------ a real server


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    models = short_tempdir("gvg")
    files = tmp_path_factory.mktemp("generic")
    for name, template in [("plain", CHATML_TEMPLATE), ("bare", None), ("native", NATIVE_TEMPLATE)]:
        (models / f"{name}.gguf").symlink_to(write_tiny_gguf(files / f"{name}.gguf", chat_template=template))
    # The tool list takes several hundred tokens of the tiny byte-level vocab.
    with running(Server(models, model="plain", env={"GPUVISOR_N_CTX": "4096"})) as server:
        yield server


@pytest.fixture(scope="module")
def client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_api_models_says_which_format(srv: Server) -> None:
    models = {m["id"]: m for m in httpx.get(srv.base_url + "/api/models", timeout=30).json()["data"]}
    assert models["plain"]["tool_format"] == "generic"
    assert models["bare"]["tool_format"] == "generic"
    assert models["native"]["tool_format"] == "native-hermes"


def prompt_tokens(client: openai.OpenAI, prompt: str) -> int:
    """How many tokens the model reads for ``prompt`` (legacy completions count it)."""
    done = client.completions.create(model="plain", prompt=prompt, max_tokens=1)
    assert done.usage is not None
    return done.usage.prompt_tokens


def test_the_prompt_the_model_reads_offers_the_tools(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="plain", messages=ASK, tools=TOOLS, max_tokens=1)
    bare = client.chat.completions.create(model="plain", messages=ASK, max_tokens=1)
    assert reply.usage is not None and bare.usage is not None
    expected = render(CHATML_TEMPLATE, plan_for(CHATML_TEMPLATE))
    assert '"name": "book_table"' in expected and '{"response": ' in expected
    # Exactly the prompt with the tools, and much more than without them.
    assert reply.usage.prompt_tokens == prompt_tokens(client, expected)
    assert reply.usage.prompt_tokens > bare.usage.prompt_tokens + 100
    # "none" offers nothing: the prompt is the one without tools.
    none = client.chat.completions.create(model="plain", messages=ASK, tools=TOOLS, tool_choice="none",
                                          max_tokens=8)
    assert none.usage is not None and none.usage.prompt_tokens == bare.usage.prompt_tokens
    assert none.choices[0].message.tool_calls is None


@pytest.mark.parametrize("model", ["plain", "bare"])
def test_a_required_call_validates_against_its_schema(client: openai.OpenAI, model: str) -> None:
    names = set()
    for seed in range(4):
        # Room for eight parallel calls of about a hundred byte-level tokens each.
        reply = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                               max_tokens=1000, seed=seed)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls
        for call in function_calls(choice.message):
            assert call.id.startswith("call_")
            check_call(call.function.name, call.function.arguments)
            names.add(call.function.name)
    assert names <= {"book_table", "get_time"}


def test_a_named_call_and_allowed_tools(client: openai.OpenAI) -> None:
    named: Any = {"type": "function", "function": {"name": "book_table"}}
    reply = client.chat.completions.create(model="plain", messages=ASK, tools=TOOLS, tool_choice=named,
                                           max_tokens=300)
    [call] = function_calls(reply.choices[0].message)
    assert call.function.name == "book_table"
    assert check_call("book_table", call.function.arguments)["city"] in ("Paris", "Oslo")
    allowed: Any = {"type": "allowed_tools", "allowed_tools": {
        "mode": "required", "tools": [{"type": "function", "function": {"name": "get_time"}}]}}
    reply = client.chat.completions.create(model="plain", messages=ASK, tools=TOOLS, tool_choice=allowed,
                                           max_tokens=300, parallel_tool_calls=False)
    [call] = function_calls(reply.choices[0].message)
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {}


def test_auto_answers_or_calls_and_never_drops_the_tools(client: openai.OpenAI) -> None:
    for seed in range(6):
        reply = client.chat.completions.create(model="plain", messages=ASK, tools=TOOLS, max_tokens=120,
                                               seed=seed, parallel_tool_calls=False)
        choice = reply.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
            [call] = function_calls(choice.message)
            check_call(call.function.name, call.function.arguments)
        else:
            # An answer: the decoded string of {"response": ...}, never the JSON around it.
            assert isinstance(choice.message.content, str)
            assert not choice.message.content.startswith('{"response"')


def streamed(client: openai.OpenAI, **kwargs: Any) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    """(finish reason, content, calls) accumulated from the raw chunks, as a
    client does (the SDK's helper refuses replies cut by the token limit)."""
    finish: str | None = None
    content: str | None = None
    calls: dict[int, tuple[str, str]] = {}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            if choice.delta.content:
                content = (content or "") + choice.delta.content
            for call in choice.delta.tool_calls or []:
                name, args = calls.get(call.index, ("", ""))
                fn = call.function
                calls[call.index] = (name + ((fn.name or "") if fn else ""), args + ((fn.arguments or "") if fn else ""))
    return finish, content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_streamed_equals_whole(client: openai.OpenAI, choice: str) -> None:
    kwargs: Any = {"model": "plain", "messages": ASK, "tools": TOOLS, "tool_choice": choice,
                   "temperature": 0, "max_tokens": 200}
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in function_calls(whole.message)]
    assert streamed(client, **kwargs) == (whole.finish_reason, whole.message.content, calls)
    if choice == "required":
        with client.chat.completions.stream(**kwargs) as stream:
            final = stream.get_final_completion().choices[0]
        assert [(c.function.name, c.function.arguments) for c in function_calls(final.message)] == calls


def test_a_second_turn_carries_the_call_and_its_result(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model="plain", messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=300)
    [call] = function_calls(first.choices[0].message)
    history: Any = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "booked for 8"}]
    final = client.chat.completions.create(model="plain", messages=history, tools=TOOLS, max_tokens=1)
    assert final.usage is not None
    calls = [{"id": call.id, "type": "function",
              "function": {"name": call.function.name, "arguments": call.function.arguments}}]
    messages = [*asked(), ChatMessage("assistant", None, tool_calls=calls),
                ChatMessage("tool", "booked for 8", tool_call_id=call.id, name=call.function.name)]
    expected = render(CHATML_TEMPLATE, plan_for(CHATML_TEMPLATE, messages=messages))
    assert '{"tool_response": {"name": ' in expected and call.function.name in expected
    assert final.usage.prompt_tokens == prompt_tokens(client, expected)


RESPONSES_TOOLS: Any = [{"type": "function", **t["function"]} for t in TOOLS]


def test_responses_get_function_call_items(client: openai.OpenAI) -> None:
    kwargs: Any = {"model": "plain", "input": "A table in Oslo?", "tools": RESPONSES_TOOLS,
                   "tool_choice": "required", "temperature": 0, "max_output_tokens": 300,
                   "parallel_tool_calls": False}
    made = client.responses.create(**kwargs)
    [item] = [o for o in made.output if o.type == "function_call"]
    check_call(item.name, item.arguments)
    with client.responses.stream(**kwargs) as stream:
        done = [e for e in stream if e.type == "response.function_call_arguments.done"]
        final = stream.get_final_response()
    [streamed] = [o for o in final.output if o.type == "function_call"]
    assert (streamed.name, streamed.arguments) == (item.name, item.arguments)
    assert [e.arguments for e in done] == [item.arguments]
    # "auto" on Responses: an answer is output text, a call a function_call item.
    auto = client.responses.create(**{**kwargs, "tool_choice": "auto"})
    kinds = {o.type for o in auto.output}
    assert kinds in ({"message"}, {"function_call"}), kinds
    if kinds == {"function_call"}:
        [item] = auto.output
        assert item.type == "function_call"
        check_call(item.name, item.arguments)
