"""The tool-call formats of Qwen3-Coder, GLM 4.5, Kimi K2, Functionary v3.2,
Command R7B, Granite and Nemotron: what the forcing grammar makes a random
model write parses back as calls with schema-valid arguments, and the
parser's edge cases (typed XML values, text markers, calls cut short,
another family's markup)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from supervisor.generation.parse import OutputParser, Piece, Reasoning, Text, ToolCall
from supervisor.generation.tagged_grammar import TaggedStyle, forced_call_grammar

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo"]},
        "days": {"type": "integer"},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
# A free string: raw text in the XML formats, bounded there (JSON strings are the JSON grammar's).
NOTE = {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"]}
TOOLS: list[tuple[str, dict[str, Any] | None]] = [("get_weather", WEATHER), ("ping", None)]
SCHEMAS = {**dict(TOOLS), "note": NOTE}
STYLES: list[TaggedStyle] = ["qwen3_coder", "glm45", "kimi_k2", "functionary_v32", "command_r7b", "granite",
                             "nemotron"]


def parse(text: str, style: str, step: int = 1000, forced: bool = False) -> list[Piece]:
    parser = OutputParser(tool_names=frozenset(SCHEMAS), style=style, schemas=SCHEMAS, forced=forced)
    out: list[Piece] = []
    for i in range(0, len(text), step):
        out += parser.feed(text[i : i + step])
    out += parser.finish()
    merged: list[Piece] = []
    for piece in out:
        if isinstance(piece, Text) and merged and isinstance(merged[-1], Text):
            merged[-1] = Text(merged[-1].text + piece.text)
        else:
            merged.append(piece)
    return merged


# ---------------------------------------------- generation under the grammar


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The engine the worker runs, in-process, its listener on a private socket."""
    import xllamacpp

    from supervisor.models.demo import write_tiny_gguf
    from tests.server import short_tempdir

    path = write_tiny_gguf(Path(tmp_path_factory.mktemp("tagged")) / "tiny.gguf")
    params = xllamacpp.CommonParams()
    params.model.path = str(path)
    params.n_ctx = 1024
    params.cpuparams.n_threads = 1
    params.cpuparams_batch.n_threads = 1
    params.warmup = False
    params.hostnames = [str(short_tempdir("gvt") / "e.sock")]
    yield xllamacpp.Server(params)


def generate(llm: Any, grammar: str, seed: int) -> str:
    out = llm.handle_completions({"prompt": "call", "grammar": grammar, "max_tokens": 3000,
                                  "temperature": 1.0, "seed": seed})
    assert "error" not in out, out
    assert out["choices"][0]["finish_reason"] == "stop", out
    return str(out["choices"][0]["text"])


@pytest.mark.parametrize("parallel", [False, True], ids=["one", "parallel"])
@pytest.mark.parametrize("style", STYLES)
def test_forced_output_parses_as_valid_calls(llm: Any, style: TaggedStyle, parallel: bool) -> None:
    for seed in (1, 2, 3):
        tools = [*TOOLS, ("note", NOTE)] if style in ("qwen3_coder", "glm45") else TOOLS
        text = generate(llm, forced_call_grammar(tools, style=style, parallel=parallel), seed)
        pieces = parse(text, style, step=5, forced=True)
        assert pieces and all(isinstance(p, ToolCall) and p.complete for p in pieces), text
        assert parallel or len(pieces) == 1
        for call in pieces:
            assert isinstance(call, ToolCall)
            args = json.loads(call.arguments)
            jsonschema.validate(args, SCHEMAS[call.name] or {"type": "object", "maxProperties": 0})


def test_named_function_and_think_prefix(llm: Any) -> None:
    grammar = forced_call_grammar([("get_weather", WEATHER)], style="qwen3_coder", parallel=False,
                                  prefix="</think>\n\n")
    assert grammar.startswith('root ::= "</think>\\n\\n" call')
    text = generate(llm, grammar, 4)
    parser = OutputParser(tool_names=frozenset(SCHEMAS), style="qwen3_coder", schemas=SCHEMAS, forced=True,
                          starts_in_reasoning=True)
    pieces = [p for p in parser.feed(text) + parser.finish() if not isinstance(p, Reasoning)]
    [call] = pieces
    assert isinstance(call, ToolCall) and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)


def test_older_styles_are_handed_on() -> None:
    assert forced_call_grammar(TOOLS, style="hermes", parallel=False).startswith("root ::= hermes-call\n")
    with pytest.raises(ValueError, match="at least one tool"):
        forced_call_grammar([], style="granite", parallel=False)


# ------------------------------------------------------- the parser's cases


def test_xml_values_are_typed_by_the_schema() -> None:
    # "12" is a string where the schema says so, a number where it says integer.
    schemas: dict[str, Any] = {"f": {"type": "object", "properties": {"s": {"type": "string"},
                                                                      "n": {"type": "integer"},
                                                                      "o": {"type": "object"}}}}
    parser = OutputParser(tool_names=frozenset(schemas), style="qwen3_coder", schemas=schemas)
    text = ("<tool_call>\n<function=f>\n<parameter=s>\n12\n</parameter>\n<parameter=n>\n12\n</parameter>\n"
            '<parameter=o>\n{"k": [1, 2]}\n</parameter>\n<parameter=x>\nfree text <b>\n</parameter>\n'
            "</function>\n</tool_call>")
    [call] = parser.feed(text) + parser.finish()
    assert isinstance(call, ToolCall)
    assert json.loads(call.arguments) == {"s": "12", "n": 12, "o": {"k": [1, 2]}, "x": "free text <b>"}
    glm = ("<tool_call>f\n<arg_key>s</arg_key>\n<arg_value>12</arg_value>\n"
           "<arg_key>n</arg_key>\n<arg_value>7</arg_value>\n</tool_call>")
    parser = OutputParser(tool_names=frozenset(schemas), style="glm45", schemas=schemas)
    [call] = parser.feed(glm) + parser.finish()
    assert isinstance(call, ToolCall) and json.loads(call.arguments) == {"s": "12", "n": 7}


@pytest.mark.parametrize("step", [1, 1000])
def test_functionary_text_and_calls(step: int) -> None:
    text = '>>>all\nLet me check.>>>get_weather\n{"city": "Oslo", "days": 1}\n>>>ping\n{}'
    assert parse(text, "functionary_v32", step) == [
        Text("Let me check."), ToolCall("get_weather", '{"city": "Oslo", "days": 1}'), ToolCall("ping", "{}")]
    assert parse(">>>all\nSunny.", "functionary_v32", step) == [Text("Sunny.")]
    # Under another family ">>>" is text, as in a Python prompt.
    assert parse(">>> print(1)", "hermes", step) == [Text(">>> print(1)")]


@pytest.mark.parametrize("step", [1, 1000])
def test_r7b_response_markers_are_dropped(step: int) -> None:
    assert parse("<|START_RESPONSE|>Sunny.<|END_RESPONSE|>", "command_r7b", step) == [Text("Sunny.")]


@pytest.mark.parametrize(
    ("style", "cut", "name", "args"),
    [
        ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=da",
         "get_weather", '{"city": "Oslo"'),
        ("glm45", "<tool_call>get_wea", "get_weather", ""),
        ("kimi_k2", '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
                    '<|tool_call_argument_begin|>{"city": "Os', "get_weather", '{"city": "Os'),
        ("functionary_v32", '>>>get_weather\n{"city"', "get_weather", '{"city"'),
        ("command_r7b", '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"ci',
         "get_weather", '{"ci'),
        ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Pa', "get_weather", '{"city": "Pa'),
        ("nemotron", '<TOOLCALL>[{"name": "ping", "arguments": {', "ping", "{"),
    ],
)
def test_a_call_cut_short_is_an_incomplete_call(style: str, cut: str, name: str, args: str) -> None:
    for step in (1, 1000):
        assert parse(cut, style, step) == [ToolCall(name, args, complete=False)]


@pytest.mark.parametrize("style", STYLES)
def test_unknown_tools_stay_text_and_other_markup_is_text(style: str) -> None:
    text = '<TOOLCALL>[{"name": "rm_rf", "arguments": {}}]</TOOLCALL>'
    pieces = parse(text, style)
    assert not any(isinstance(p, ToolCall) for p in pieces)
    assert "".join(p.text for p in pieces if isinstance(p, Text)).strip()


def test_the_profile_names_each_format() -> None:
    from supervisor.generation.profile import profile_for

    # Kimi K2's first template only declares the tools; its calls are still its own.
    kimi = profile_for("{% if tools %}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}{% endif %}")
    assert kimi.tool_format == "native-kimi_k2" and kimi.tool_support == "native"
    r7b = profile_for("{{ tools }}<|START_THINKING|><|END_THINKING|><|START_ACTION|>")
    assert (r7b.tool_format, r7b.thinks) == ("native-command_r7b", True)
    # Functionary's ">>>all" wins over the Llama 3 headers it is written in.
    fn = profile_for("<|start_header_id|>{{ tools }} parameters >>>all\n")
    assert fn.tool_format == "native-functionary_v32"
