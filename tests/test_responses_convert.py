"""Request decoding and conversation -> chat messages."""

from __future__ import annotations

import msgspec
import pytest

from supervisor.api.io import decode_json
from supervisor.errors import BadRequest
from supervisor.generation.profile import profile_for
from supervisor.responses.convert import template_tools, to_messages
from supervisor.responses.items import FunctionCallItem, Item, MessageItem, OutputText
from supervisor.responses.models import CreateRequest, decode_items, validate
from worker.protocol import ChatMessage


def body(**fields: object) -> CreateRequest:
    return decode_json(msgspec.json.encode({"model": "m", **fields}), CreateRequest)


def test_string_input_is_one_user_message() -> None:
    valid = validate(body(input="hi"))
    assert to_messages([], valid.items, "be brief") == [
        ChatMessage(role="system", content="be brief"),
        ChatMessage(role="user", content="hi"),
    ]


def test_items_get_ids_and_list_content() -> None:
    items = decode_items(
        [
            {"role": "user", "content": "a"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "b"}],
             "id": "msg_given", "status": "completed", "phase": "final_answer"},
        ]
    )
    first, second = items
    assert isinstance(first, MessageItem) and first.id.startswith("msg_")
    assert isinstance(second, MessageItem) and second.id == "msg_given"
    assert second.content == [OutputText("b")]


def test_function_call_round_trip_merges_one_assistant_turn() -> None:
    items = decode_items(
        [
            {"role": "developer", "content": "dev note"},
            {"role": "user", "content": "weather?"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "t"}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "rain"},
        ]
    )
    msgs = to_messages([], items, None)
    assert msgs[0] == ChatMessage(role="system", content="dev note")
    assistant = msgs[2]
    assert assistant.role == "assistant" and assistant.reasoning_content == "t"
    assert assistant.tool_calls == [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}
    ]
    assert msgs[3] == ChatMessage(role="tool", content="rain", tool_call_id="c1", name="get_weather")


def test_history_supplies_the_call_for_an_output() -> None:
    history: list[Item] = [FunctionCallItem(call_id="c9", name="f", arguments="{}", id="fc_1")]
    items = decode_items([{"type": "function_call_output", "call_id": "c9", "output": [{"type": "input_text", "text": "ok"}]}])
    assert to_messages(history, items, None)[-1].content == "ok"


def test_output_without_matching_call_names_the_field() -> None:
    items = decode_items([{"role": "user", "content": "x"}, {"type": "function_call_output", "call_id": "nope", "output": "o"}])
    with pytest.raises(BadRequest) as err:
        to_messages([], items, None)
    assert err.value.param == "input[1].call_id"


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        ([{"type": "function_call_output", "output": "x"}], "input[0].call_id"),
        ([{"role": "user", "content": "a"}, {"type": "bogus"}], "input[1].type"),
        ([{"role": "user", "content": [{"type": "input_video", "video_url": "x"}]}], "input[0].content[0].type"),
        # An image part is known: its URL is what is wrong.
        ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "input[0].content[0]"),
        ([{"role": "robot", "content": "a"}], "input[0].role"),
        ([{"type": "function_call", "call_id": "c", "arguments": "{}"}], "input[0].name"),
        (["just a string"], "input[0]"),
    ],
)
def test_bad_items_name_the_field(raw: list[object], param: str) -> None:
    with pytest.raises(BadRequest) as err:
        validate(body(input=raw))
    assert err.value.param == param


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": "x", "tools": [{"type": "custom", "name": "patch"}]}, "tools[0].type"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format"),
        ({"input": "x", "tool_choice": "sometimes"}, "tool_choice"),
        ({"input": "x", "truncation": "sometimes"}, "truncation"),
        ({"input": "x", "temperature": 3}, "temperature"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "reasoning": {"effort": "huge"}}, "reasoning.effort"),
        ({"input": "x", "conversation": "conv_1"}, "conversation"),
        ({"input": "x", "metadata": {"k": 1}}, "metadata[...]"),
    ],
)
def test_bad_fields_name_the_field(fields: dict[str, object], param: str) -> None:
    with pytest.raises(BadRequest) as err:
        body(**fields)
    assert err.value.param == param


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({}, "input"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
         "tool_choice.name"),
        ({"input": "x", "tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "f"}]},
         "tools[1].name"),
        ({"input": "x", "background": True, "store": False}, "background"),
    ],
)
def test_cross_field_rules(fields: dict[str, object], param: str) -> None:
    with pytest.raises(BadRequest) as err:
        validate(body(**fields))
    assert err.value.param == param


def test_template_tools_nest_the_function() -> None:
    req = body(input="x", tools=[{"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}}])
    assert template_tools(req.tools) == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "description": "d"}}
    ]


def test_profiles() -> None:
    qwen3 = (
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
        "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
        "{%- endif %}{%- endif %}<tool_call>"
    )
    p = profile_for(qwen3)
    assert p.thinks and not p.starts_in_reasoning and p.tool_style == "hermes"
    assert p.template_vars("none") == {"enable_thinking": False}
    assert p.template_vars("high") == {"enable_thinking": True}
    assert p.template_vars(None) == {}
    r1 = "{% if add_generation_prompt %}{{'<|Assistant|><think>\\n'}}{% endif %}"
    assert profile_for(r1).starts_in_reasoning
    literal = "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
    assert profile_for(literal).starts_in_reasoning
    assert profile_for("[TOOL_CALLS] {{ reasoning_effort }}").tool_style == "mistral"
    assert profile_for("{{ reasoning_effort }}").template_vars("low") == {"reasoning_effort": "low"}
    assert profile_for(None) == profile_for("")
