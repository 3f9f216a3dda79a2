"""Malformed call JSON: the two safe repairs are made, every other slip is
refused, and a call the model closed but that cannot be repaired stays text
with one warning line in the log."""

from __future__ import annotations

import json
import logging

import pytest

from supervisor.generation.arg_repair import repair_json
from supervisor.generation.parse import OutputParser, Piece, Text, ToolCall


@pytest.mark.parametrize(
    ("broken", "fixed", "what"),
    [
        ('{"a": 1,}', '{"a": 1}', "1 trailing comma(s)"),
        ('{"a": [1, 2, ], "b": {"c": 3 ,\n}}', '{"a": [1, 2 ], "b": {"c": 3 \n}}', "2 trailing comma(s)"),
        ('{"a": {"b": 1}', '{"a": {"b": 1}}', "closed }"),
        ('{"a": [1, {"b": "x}"}', '{"a": [1, {"b": "x}"}]}', "closed ]}"),
        ('{"a": [1,], "b": true', '{"a": [1], "b": true}', "1 trailing comma(s), closed }"),
        # Commas and brackets inside strings are text, not syntax.
        ('{"a": "[,]", "b": "\\",}"', '{"a": "[,]", "b": "\\",}"}', "closed }"),
    ],
)
def test_safe_repairs(broken: str, fixed: str, what: str) -> None:
    repaired = repair_json(broken)
    assert repaired is not None and (repaired.text, repaired.what) == (fixed, what)
    json.loads(repaired.text)


@pytest.mark.parametrize(
    "broken",
    [
        '{"city": "Os',  # a string cut short: its value is unknown
        '{"a": 1,',  # something was to follow the comma
        '{"a":',  # a key with no value
        '{"a"',  # a key alone
        '{"a": [1}',  # a closer that does not match
        '{"a": tru',  # a literal cut short
        '{"a": 1}}',  # one closer too many
        "{",  # nothing written
        '{"a": 1}',  # whole already: nothing to repair
        "not json",
        "[" * 300 + "1",  # deeper than the repair tracks
    ],
)
def test_unsafe_or_needless_repairs_are_refused(broken: str) -> None:
    assert repair_json(broken) is None


def parse(text: str, style: str = "hermes") -> list[Piece]:
    parser = OutputParser(tool_names=frozenset({"f"}), style=style)
    return parser.feed(text) + parser.finish()


@pytest.mark.parametrize(
    ("style", "text"),
    [
        ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>'),
        ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1,},}\n</tool_call>'),
        ("nemotron", '<TOOLCALL>[{"name": "f", "arguments": {"a": 1}},]</TOOLCALL>'),
        ("command_r7b",
         '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "f", "parameters": {"a": 1}<|END_ACTION|>'),
        ("kimi_k2", '<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>'
                    '{"a": 1,}<|tool_call_end|><|tool_calls_section_end|>'),
        ("kimi_k2", '<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>'
                    '{"a": 1<|tool_call_end|><|tool_calls_section_end|>'),
    ],
)
def test_a_closed_call_with_a_slip_is_repaired(style: str, text: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="supervisor.generation.parse"):
        [call] = parse(text, style)
    assert isinstance(call, ToolCall) and call.complete and json.loads(call.arguments) == {"a": 1}
    assert any("repaired" in r.getMessage() for r in caplog.records)


def test_an_unrepairable_call_stays_text_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    text = '<tool_call>\n{"name": "f", "arguments": {"a": "cut\n</tool_call>'
    with caplog.at_level(logging.WARNING, logger="supervisor.generation.parse"):
        pieces = parse(text)
    assert pieces == [Text(text)]
    [record] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "left as text" in record.getMessage() and "\n" not in record.getMessage()


def test_a_call_the_output_ended_inside_is_not_repaired() -> None:
    # No closing tag: the token limit cut it, so it is an incomplete call, not a whole one.
    [call] = parse('<tool_call>\n{"name": "f", "arguments": {"a": 1}')
    assert call == ToolCall("f", '{"a": 1}', complete=False)
    [call] = parse('<|tool_call|>[{"name": "f", "arguments": {"a": 1}', "granite")
    assert isinstance(call, ToolCall) and not call.complete
