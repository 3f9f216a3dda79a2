"""Tool calls and reasoning with the published chat templates of real models.

The templates (tests/fixtures/templates, see its README) are the models' own:
Qwen 2.5 and 3, Llama 3.1 and 3.2, Mistral Nemo and Small 3.2, gpt-oss
(harmony) and DeepSeek-R1 (distilled onto Qwen); and templates of our own
that write the formats of Qwen3-Coder, Hermes 2 Pro, Functionary v3.2,
GLM 4.5, Kimi K2, Command R7B, Granite and Nemotron. For each one:

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

import re
from typing import Any

import pytest

from supervisor.generation.parse import Piece, Reasoning, Text, ToolCall
from supervisor.generation.profile import profile_for
from supervisor.responses.models import FunctionTool
from supervisor.responses.runner import tool_plan
from tests.real_templates import (
    FAMILIES,
    HERMES_CALL,
    IDS,
    LLAMA_CALL,
    R1_CALL,
    THINKERS,
    TOOLS,
    WEATHER,
    Family,
    by_name,
)
from worker.chat_template import ChatRenderer, TemplateError
from worker.protocol import ChatMessage, SamplingParams

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
    for part in ("Weather in Oslo?", family.history_call, "12 degrees", "It is 12 degrees in Oslo.", "And in Paris?"):
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
