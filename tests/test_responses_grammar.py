"""Tool-call grammars: well-formed GBNF, and what they force parses back."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from formats.schema_gbnf import SchemaGrammar, gbnf_literal, schema_gbnf
from supervisor.generation.grammar import ToolStyle, tool_call_grammar
from supervisor.generation.parse import OutputParser, Piece, ToolCall

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo"]},
        "days": {"type": "integer"},
        "metric": {"type": "boolean"},
    },
    "required": ["city"],
}
NESTED = {
    "type": "object",
    "$defs": {"unit": {"enum": ["c", "f"]}},
    "properties": {
        "unit": {"$ref": "#/$defs/unit"},
        "tags": {"type": "array", "items": {"const": "x"}},
        "mode": {"anyOf": [{"type": "null"}, {"enum": ["fast"]}]},
    },
    "required": ["unit", "tags", "mode"],
}
TOOLS: list[tuple[str, dict[str, Any] | None]] = [("get_weather", WEATHER), ("nested", NESTED), ("ping", None)]


def test_literal_escaping() -> None:
    assert gbnf_literal('a"b\\c\n') == '"a\\"b\\\\c\\n"'


def test_rules_per_style() -> None:
    hermes = tool_call_grammar(TOOLS, style="hermes", parallel=False)
    assert hermes.startswith("root ::= hermes-call\n")
    assert '"<tool_call>\\n" call "\\n</tool_call>"' in hermes
    assert '\\"arguments\\": "' in hermes
    assert '\\"parameters\\": "' in tool_call_grammar(TOOLS, style="llama3", parallel=False)
    mistral = tool_call_grammar(TOOLS, style="mistral", parallel=True)
    assert mistral.startswith('root ::= "[TOOL_CALLS][" call ( ", " call ){0,7} "]"')


def test_rules_of_the_newer_styles() -> None:
    args = tool_call_grammar(TOOLS, style="mistral_args", parallel=True)
    assert args.startswith('root ::= "[TOOL_CALLS]" call ( "[TOOL_CALLS]" call ){0,7}')
    assert '"get_weather[ARGS]" args-get-weather' in args
    deepseek = tool_call_grammar(TOOLS, style="deepseek", parallel=False)
    assert deepseek.startswith('root ::= "<｜tool▁calls▁begin｜>" call "<｜tool▁calls▁end｜>"')
    assert '"<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\\n```json\\n"' in deepseek
    # One gpt-oss call per turn: its <|call|> token ends the generation.
    harmony = tool_call_grammar(TOOLS, style="harmony", parallel=True)
    assert harmony.startswith("root ::= call\n")
    assert '"<|channel|>commentary to=functions.ping <|constrain|>json<|message|>" empty-object' in harmony
    # A template that opened a think block has it closed before the call.
    closed = tool_call_grammar(TOOLS, style="hermes", parallel=False, prefix="</think>\n\n")
    assert closed.startswith('root ::= "</think>\\n\\n" hermes-call\n')


def test_object_without_required_keys_allows_any_ordered_subset() -> None:
    g = SchemaGrammar()
    name = g.schema_rule({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "null"}}}, "o")
    # Either "a" (then maybe "b") or "b" alone, or nothing: {}, {a}, {b}, {a, b}.
    assert g.rules[name] == '"{" ws ( o-kv o-tail | o-kv-2 )? ws "}"'
    assert g.rules["o-tail"] == '( "," ws o-kv-2 )?'
    assert g.rules["o-kv"] == '"\\"a\\"" ":" ws integer' and g.rules["o-kv-2"] == '"\\"b\\"" ":" ws null'
    assert g.schema_rule({"type": "object", "additionalProperties": False}, "e") == "empty-object"
    assert g.schema_rule({}, "any") == "value"


def test_recursive_ref_terminates() -> None:
    schema = {"$defs": {"node": {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#/$defs/node"},
                                                                                     {"type": "null"}]}}}},
              "$ref": "#/$defs/node"}
    g = SchemaGrammar()
    assert g.schema_rule(schema, "root", root=schema) == "ref-node"
    assert "ref-node-body-next ::= ref-node | null" in g.render("ref-node")


# ---------------------------------------------- generation under the grammar


@pytest.fixture(scope="module", params=["spm", "bpe"])
def llm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The engine the worker runs, in-process, its listener on a private socket;
    on each of the test vocabs (SentencePiece, and byte-level BPE as real
    models have), since a grammar meets the vocab's tokens, not the text."""
    import xllamacpp

    from supervisor.models.demo import write_tiny_gguf
    from tests.server import short_tempdir
    from tests.tiny_bpe import write_tiny_bpe

    folder = Path(tmp_path_factory.mktemp("gram"))
    path = write_tiny_gguf(folder / "tiny.gguf") if request.param == "spm" else write_tiny_bpe(folder / "bpe.gguf")
    params = xllamacpp.CommonParams()
    params.model.path = str(path)
    params.n_ctx = 512
    params.cpuparams.n_threads = 1
    params.cpuparams_batch.n_threads = 1
    params.warmup = False
    params.hostnames = [str(short_tempdir("gvg") / "e.sock")]
    yield xllamacpp.Server(params)


def generate(llm: Any, grammar: str, seed: int, prompt: str = "call") -> str:
    out = llm.handle_completions({"prompt": prompt, "grammar": grammar, "max_tokens": 300,
                                  "temperature": 1.0, "seed": seed})
    assert "error" not in out, out
    assert out["choices"][0]["finish_reason"] == "stop", out
    return str(out["choices"][0]["text"])


def parse_all(text: str) -> list[Piece]:
    parser = OutputParser(tool_names=frozenset(name for name, _ in TOOLS))
    return parser.feed(text) + parser.finish()


def check_call(call: ToolCall) -> None:
    args = json.loads(call.arguments)
    assert isinstance(args, dict)
    if call.name == "get_weather":
        assert args["city"] in ("Paris", "Oslo") and set(args) <= {"city", "days", "metric"}
    elif call.name == "nested":
        assert args["unit"] in ("c", "f") and set(args["tags"]) <= {"x"} and args["mode"] in (None, "fast")


@pytest.mark.parametrize("style", ["hermes", "mistral", "mistral_args", "llama3", "deepseek"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_forced_output_parses_as_calls(llm: Any, style: ToolStyle, seed: int) -> None:
    text = generate(llm, tool_call_grammar(TOOLS, style=style, parallel=False), seed)
    pieces = parse_all(text)
    assert len(pieces) == 1 and isinstance(pieces[0], ToolCall), text
    check_call(pieces[0])


def test_named_function_only(llm: Any) -> None:
    text = generate(llm, tool_call_grammar([("nested", NESTED)], style="hermes", parallel=False), 5)
    (call,) = parse_all(text)
    assert isinstance(call, ToolCall) and call.name == "nested"
    check_call(call)


def test_json_schema_output_is_valid_json_without_raw_control_characters(llm: Any) -> None:
    """Strict clients (``chat.completions.parse``, pydantic) reject raw control
    characters in JSON strings; the worker's schema grammar never emits them.
    The random model rambles inside strings, so some answers are cut by
    max_tokens: those must still be clean, and the finished ones parse."""
    schema = {"type": "object", "properties": {"note": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["note", "n"], "additionalProperties": False}
    grammar = schema_gbnf(schema)
    finished = 0
    for seed in range(12):
        out = llm.handle_completions({"prompt": "json:", "grammar": grammar, "max_tokens": 200,
                                      "temperature": 1.0, "seed": seed})
        text = str(out["choices"][0]["text"])
        assert text.startswith("{"), text
        assert not any(ord(c) < 0x20 or c == "\x7f" for c in text), repr(text)
        if out["choices"][0]["finish_reason"] == "stop":
            value = json.loads(text)  # strict: a raw control character fails here
            assert set(value) == {"note", "n"} and isinstance(value["n"], int)
            finished += 1
    assert finished >= 1


def test_optional_properties_grow_the_grammar_linearly() -> None:
    """No required key used to mean every ordered subset spelled out (N²):
    4,500 properties made a 384 MB grammar."""
    import time

    sizes = {}
    for n in (100, 4000):
        schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}
        t0 = time.perf_counter()
        sizes[n] = len(schema_gbnf(schema))
        assert time.perf_counter() - t0 < 5  # a coarse bound against a blow-up, not a timing
    assert sizes[4000] < 45 * sizes[100]


def test_many_optional_properties_force_a_call(llm: Any) -> None:
    """45 optional properties made llama.cpp's grammar parser give up (and
    crashed the old engine); the linear grammar loads and parses back."""
    params = {"type": "object", "properties": {f"field_{i}": {"type": "string", "enum": ["x"]} for i in range(45)}}
    text = generate(llm, tool_call_grammar([("many", params)], style="hermes", parallel=False), 3)
    parser = OutputParser(tool_names=frozenset({"many"}))
    (call,) = parser.feed(text) + parser.finish()
    assert isinstance(call, ToolCall) and set(json.loads(call.arguments)) <= set(params["properties"])
