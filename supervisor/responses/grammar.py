"""GBNF grammars that force a well-formed tool call.

Used for ``tool_choice: "required"`` and for a named function: the output must
be one call (or, with ``parallel_tool_calls``, a few) in the model's own
tool-call format, each with arguments matching that tool's JSON schema. The
schema support is a practical subset (types, properties, required, enum,
const, items, anyOf/oneOf, local ``$ref``); anything else falls back to any
JSON value of the right shape. Whitespace is limited to one optional space so
a model cannot pad forever.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from worker.schema_gbnf import SchemaGrammar, gbnf_literal

ToolStyle = Literal["hermes", "mistral", "llama3"]

MAX_PARALLEL_CALLS = 8


def _call_rule(g: SchemaGrammar, name: str, parameters: dict[str, Any] | None, style: ToolStyle) -> str:
    # A tool that declares no parameters takes none; arguments are always an object.
    args = g.schema_rule(parameters, f"args-{name}", root=parameters) if parameters else "empty-object"
    if args == "value":
        args = "object"
    key = "parameters" if style == "llama3" else "arguments"
    head = gbnf_literal('{"name": ' + json.dumps(name) + f', "{key}": ')
    return g.add(f"call-{name}", f'{head} {args} "}}"')


def tool_call_grammar(
    tools: list[tuple[str, dict[str, Any] | None]],
    *,
    style: ToolStyle,
    parallel: bool,
) -> str:
    """GBNF forcing calls to one of ``tools`` (name, JSON schema of arguments)."""
    if not tools:
        raise ValueError("tool_call_grammar needs at least one tool")
    g = SchemaGrammar()
    calls = [_call_rule(g, name, params, style) for name, params in tools]
    call = g.add("call", " | ".join(calls))
    more = f"{{0,{MAX_PARALLEL_CALLS - 1}}}" if parallel else "{0,0}"
    if style == "hermes":
        one = g.add("hermes-call", f'"<tool_call>\\n" {call} "\\n</tool_call>"')
        root = f'{one} ( "\\n" {one} ){more}' if parallel else one
    elif style == "mistral":
        root = f'"[TOOL_CALLS][" {call} ( ", " {call} ){more} "]"' if parallel else f'"[TOOL_CALLS][" {call} "]"'
    else:
        root = call
    return g.render(root)
