"""GBNF grammars that force a well-formed tool call.

Used for ``tool_choice: "required"`` and for a named function: the output must
be one call (or, with ``parallel_tool_calls``, a few) in the model's own
tool-call format, each with arguments matching that tool's JSON schema. The
schema support is a practical subset (types, properties, required, enum,
const, items, anyOf/oneOf, local ``$ref``); anything else falls back to any
JSON value of the right shape. Whitespace is limited to one optional space so
a model cannot pad forever.

Formats (``ToolStyle``):
- hermes: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (Qwen, Hermes)
- mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]`` (Mistral 7B v0.3, Nemo)
- mistral_args: ``[TOOL_CALLS]name[ARGS]{...}`` (Mistral Small 3.2, Devstral, Magistral)
- llama3: ``{"name": ..., "parameters": {...}}`` as the whole output (Llama 3.1 / 3.2)
- deepseek: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>name`` then
  the arguments in a fenced json block, ``<｜tool▁call▁end｜>``, ``<｜tool▁calls▁end｜>`` (DeepSeek-R1)
- harmony: ``<|channel|>commentary to=functions.name <|constrain|>json<|message|>{...}`` (gpt-oss)

The grammar ends where the model's end-of-turn token would follow: a real
model's ``<|call|>`` (gpt-oss) is an end-of-generation token that a grammar
literal could only spell out of ordinary tokens.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from formats.schema_gbnf import SchemaGrammar, gbnf_literal

ToolStyle = Literal["hermes", "mistral", "mistral_args", "llama3", "deepseek", "harmony"]

MAX_PARALLEL_CALLS = 8

DEEPSEEK_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
DEEPSEEK_CALLS_END = "<｜tool▁calls▁end｜>"
DEEPSEEK_CALL_BEGIN = "<｜tool▁call▁begin｜>"
DEEPSEEK_CALL_END = "<｜tool▁call▁end｜>"
DEEPSEEK_SEP = "<｜tool▁sep｜>"


def args_rule(g: SchemaGrammar, name: str, parameters: dict[str, Any] | None) -> str:
    # A tool that declares no parameters takes none; arguments are always an object.
    args = g.schema_rule(parameters, f"args-{name}", root=parameters) if parameters else "empty-object"
    return "object" if args == "value" else args


def call_body(name: str, args: str, style: ToolStyle) -> str:
    """The GBNF of one call to ``name`` whose arguments match rule ``args``."""
    if style == "mistral_args":
        return f"{gbnf_literal(name + '[ARGS]')} {args}"
    if style == "deepseek":
        head = gbnf_literal(f"{DEEPSEEK_CALL_BEGIN}function{DEEPSEEK_SEP}{name}\n```json\n")
        return f'{head} {args} {gbnf_literal(chr(10) + "```" + DEEPSEEK_CALL_END)}'
    if style == "harmony":
        head = gbnf_literal(f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>")
        return f"{head} {args}"
    key = "parameters" if style == "llama3" else "arguments"
    head = gbnf_literal('{"name": ' + json.dumps(name) + f', "{key}": ')
    return f'{head} {args} "}}"'


def _root(call: str, style: ToolStyle, more: str | None) -> str:
    """The whole output: one ``call``, or up to ``more`` further ones when not None."""
    def repeated(sep: str) -> str:
        return f"{call} ( {gbnf_literal(sep)} {call} ){more}" if more else call

    if style == "hermes":
        return repeated("\n")
    if style == "mistral":
        return f'"[TOOL_CALLS][" {repeated(", ")} "]"'
    if style == "mistral_args":
        return f'"[TOOL_CALLS]" {repeated("[TOOL_CALLS]")}'
    if style == "deepseek":
        return f"{gbnf_literal(DEEPSEEK_CALLS_BEGIN)} {repeated(chr(10))} {gbnf_literal(DEEPSEEK_CALLS_END)}"
    # Llama 3 takes one call per turn (its template refuses more); a gpt-oss
    # call ends its turn with <|call|>.
    return call


def tool_call_grammar(
    tools: list[tuple[str, dict[str, Any] | None]],
    *,
    style: ToolStyle,
    parallel: bool,
    prefix: str = "",
) -> str:
    """GBNF forcing calls to one of ``tools`` (name, JSON schema of arguments).

    ``prefix`` is written first: "</think>\\n\\n" closes the think block a
    template opened, so the call comes where the model would write it.
    """
    if not tools:
        raise ValueError("tool_call_grammar needs at least one tool")
    g = SchemaGrammar()
    calls = [g.add(f"call-{name}", call_body(name, args_rule(g, name, params), style)) for name, params in tools]
    call = g.add("call", " | ".join(calls))
    if style == "hermes":
        call = g.add("hermes-call", f'"<tool_call>\\n" {call} "\\n</tool_call>"')
    root = _root(call, style, f"{{0,{MAX_PARALLEL_CALLS - 1}}}" if parallel else None)
    return g.render(f"{gbnf_literal(prefix)} {root}" if prefix else root)
