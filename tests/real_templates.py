"""The real-template families the template tests share: each published
chat template, what its model writes for a call or a reasoned answer, and
the tools and checks both test modules use."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor.generation.tagged_grammar import CallStyle

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"

# Markup of every family's calls and reasoning: none of it may reach visible text.
MARKUP = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "<|channel|>",
          "<|message|>", "<|call|>", "<|constrain|>", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>",
          "<｜tool▁sep｜>", "<think>", "</think>", "<function=", "<parameter=", "<arg_key>", "<arg_value>",
          "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>", ">>>",
          "<|START_ACTION|>", "<|END_ACTION|>", "<|START_THINKING|>", "<|END_THINKING|>", "<|START_RESPONSE|>",
          "<|END_RESPONSE|>", "<|tool_call|>",
          "<TOOLCALL>", "</TOOLCALL>")

R1_CALL = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
           '{"city": "Oslo", "unit": "c"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')


@dataclass(frozen=True)
class Family:
    """One template and what its model writes."""

    name: str  # the fixture's file name without .jinja, and the model's id
    style: CallStyle
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
    # How the call to get_weather(Oslo, c) shows in a rendered history.
    history_call: str = '"city": "Oslo"'

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
WEATHER_JSON = '{"city": "Oslo", "unit": "c"}'
# Templates of our own writing that produce a family's call format (see the fixtures' README).
FAMILIES += [
    Family("qwen3-coder", "qwen3_coder", prompt_end="<|im_start|>assistant\n",
           call_text=("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
                      "<parameter=unit>\nc\n</parameter>\n</function>\n</tool_call>"),
           bos="", eos="<|im_end|>", history_call="<parameter=city>\nOslo\n</parameter>"),
    Family("hermes-2-pro", "hermes", prompt_end="<|im_start|>assistant\n", call_text=HERMES_CALL,
           bos="", eos="<|im_end|>"),
    Family("functionary-v3.2", "functionary_v32", prompt_end="<|start_header_id|>assistant<|end_header_id|>\n\n",
           call_text=">>>get_weather\n" + WEATHER_JSON, bos="<|begin_of_text|>", eos="<|eot_id|>"),
    Family("glm-4.5", "glm45", thinks=True, prompt_end="<|assistant|>",
           answer_text="\n<think>weigh it</think>\nSunny.",
           call_text=("\n<think>The user wants the weather.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n"
                      "<arg_key>unit</arg_key>\n<arg_value>c</arg_value>\n</tool_call>"),
           bos="", eos="<|user|>", history_call="<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>"),
    Family("kimi-k2", "kimi_k2", prompt_end="<|im_assistant|>assistant<|im_middle|>",
           call_text=("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                      "<|tool_call_argument_begin|>" + WEATHER_JSON + "<|tool_call_end|><|tool_calls_section_end|>"),
           bos="", eos="<|im_end|>"),
    Family("command-r7b", "command_r7b", thinks=True, prompt_end="<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
           call_text=('<|START_THINKING|>The user wants the weather.<|END_THINKING|>'
                      '<|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "get_weather", "parameters": '
                      + WEATHER_JSON + "}\n]<|END_ACTION|>"),
           answer_text="<|START_THINKING|>weigh it<|END_THINKING|><|START_RESPONSE|>Sunny.<|END_RESPONSE|>",
           bos="<BOS_TOKEN>", eos="<|END_OF_TURN_TOKEN|>"),
    Family("granite", "granite", prompt_end="<|start_of_role|>assistant<|end_of_role|>",
           call_text='<|tool_call|>[{"name": "get_weather", "arguments": ' + WEATHER_JSON + "}]",
           bos="", eos="<|end_of_text|>"),
    Family("nemotron", "nemotron", prompt_end="<extra_id_1>Assistant\n",
           call_text='<TOOLCALL>[{"name": "get_weather", "arguments": ' + WEATHER_JSON + "}]</TOOLCALL>",
           bos="<s>", eos="</s>"),
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


def by_name(name: str) -> Family:
    return next(f for f in FAMILIES if f.name == name)
