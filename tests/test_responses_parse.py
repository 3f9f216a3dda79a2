"""Output parsing: reasoning split and tool-call formats, fed in every chunking."""

from __future__ import annotations

import json

import pytest

from supervisor.generation.parse import OutputParser, Piece, Reasoning, Text, ToolCall

NAMES = frozenset({"get_weather", "add"})


def parse(text: str, step: int | None = None, **kw: object) -> list[Piece]:
    """Feed ``text`` in chunks of ``step`` chars (all at once if None)."""
    parser = OutputParser(**kw)  # type: ignore[arg-type]
    out: list[Piece] = []
    size = step or max(1, len(text))
    for i in range(0, len(text), size):
        out += parser.feed(text[i : i + size])
    return merge(out + parser.finish())


def merge(pieces: list[Piece]) -> list[Piece]:
    """Join adjacent text/reasoning pieces: chunking must not change the result."""
    out: list[Piece] = []
    for piece in pieces:
        if out and type(out[-1]) is type(piece) and not isinstance(piece, ToolCall):
            out[-1] = type(piece)(out[-1][0] + piece[0])
        else:
            out.append(piece)
    return out


STEPS = [None, 1, 2, 3, 7]


@pytest.mark.parametrize("step", STEPS)
def test_plain_text_passes_through(step: int | None) -> None:
    assert parse("Hello <b>world</b> a < b", step) == [Text("Hello <b>world</b> a < b")]


@pytest.mark.parametrize("step", STEPS)
def test_think_block_becomes_reasoning(step: int | None) -> None:
    out = parse("<think>\nweigh it</think>\n\nThe answer.", step, thinking=True)
    assert out == [Reasoning("weigh it"), Text("The answer.")]


@pytest.mark.parametrize("step", STEPS)
def test_template_opened_think(step: int | None) -> None:
    assert parse("plan</think>done", step, starts_in_reasoning=True) == [Reasoning("plan"), Text("done")]
    # Some models repeat the opening tag the template already wrote.
    assert parse("<think>plan</think>done", step, starts_in_reasoning=True) == [Reasoning("plan"), Text("done")]


def test_unclosed_think_is_all_reasoning() -> None:
    assert parse("<think>still going", thinking=True) == [Reasoning("still going")]


def test_think_tags_ignored_for_models_that_do_not_think() -> None:
    assert parse("<think>x</think>") == [Text("<think>x</think>")]


@pytest.mark.parametrize("step", STEPS)
def test_hermes_calls(step: int | None) -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    )
    out = parse(text, step, tool_names=NAMES)
    assert out == [
        Text("Let me check.\n"),
        ToolCall("get_weather", json.dumps({"city": "Paris"})),
        ToolCall("add", json.dumps({"a": 1, "b": 2})),
    ]


def test_hermes_call_cut_by_stop_string_still_parses() -> None:
    out = parse('<tool_call>{"name": "add", "arguments": {"a": 1}}', tool_names=NAMES)
    assert out == [ToolCall("add", '{"a": 1}')]


def test_hermes_call_with_a_cut_closing_tag() -> None:
    out = parse('<tool_call>{"name": "add", "arguments": {}}\n</tool_ca', tool_names=NAMES)
    assert out == [ToolCall("add", "{}")]


def test_text_is_never_emitted_then_retracted() -> None:
    parser = OutputParser(tool_names=NAMES)
    emitted = parser.feed("ok <tool_")
    assert emitted == [Text("ok ")]
    assert parser.feed('call>{"name": "add", "arguments": {}}') == []
    assert parser.feed("</tool_call>") == [ToolCall("add", "{}")]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{not json}</tool_call>',
        '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "add", "arguments": 5}</tool_call>',
    ],
)
def test_bad_calls_stay_text(text: str) -> None:
    assert parse(text, tool_names=NAMES) == [Text(text)]


@pytest.mark.parametrize("step", STEPS)
def test_mistral_list(step: int | None) -> None:
    text = '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": "get_weather", "arguments": {}}]'
    assert parse(text, step, tool_names=NAMES) == [ToolCall("add", '{"a": 1}'), ToolCall("get_weather", "{}")]


def test_mistral_args_form() -> None:
    text = '[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]get_weather[ARGS]{}'
    assert parse(text, tool_names=NAMES) == [ToolCall("add", '{"a": 1}'), ToolCall("get_weather", "{}")]


@pytest.mark.parametrize("step", STEPS)
def test_llama3_json(step: int | None) -> None:
    text = ' {"name": "add", "parameters": {"a": 1, "b": 2}}'
    assert parse(text, step, tool_names=NAMES) == [ToolCall("add", json.dumps({"a": 1, "b": 2}))]
    tagged = '<|python_tag|>{"name": "add", "parameters": {}}'
    assert parse(tagged, step, tool_names=NAMES) == [ToolCall("add", "{}")]


def test_json_answer_is_text_when_not_a_call() -> None:
    assert parse('{"answer": 42}', tool_names=NAMES) == [Text('{"answer": 42}')]
    assert parse('{"name": "add", "parameters": {}}', tool_names=NAMES, bare_json_calls=False) == [
        Text('{"name": "add", "parameters": {}}')
    ]


def test_no_tools_means_no_call_parsing() -> None:
    text = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    assert parse(text) == [Text(text)]


def test_reasoning_then_call() -> None:
    text = '<think>need a tool</think><tool_call>{"name": "add", "arguments": {}}</tool_call>'
    assert parse(text, thinking=True, tool_names=NAMES) == [Reasoning("need a tool"), ToolCall("add", "{}")]


def test_in_reasoning_tracks_state() -> None:
    parser = OutputParser(thinking=True)
    parser.feed("<think>a")
    assert parser.in_reasoning
    parser.feed("</think>b")
    assert not parser.in_reasoning
