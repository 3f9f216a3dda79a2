"""Forced tool calls as LLGuidance grammars: the call syntax with ``%json`` arguments.

Where the model's vocab allows LLGuidance (``ModelFacts.schema_grammar``),
a forced call (``tool_choice`` "required" or a named function) is a Lark
grammar: the call syntax of the template's family around a ``%json`` rule
per tool, so the arguments hold every keyword LLGuidance implements
(counts, lengths, patterns, formats, bounds), not only the GBNF subset of
supervisor/generation/grammar.py. The layout mirrors that module's, so the
parsers read both alike.

Families whose call markup is plain text in real vocabs go through here:
Hermes (``<tool_call>`` is an ordinary added token in Qwen's vocabs), Llama
3's bare JSON and llama.cpp's generic JSON format. The others (Mistral's
``[TOOL_CALLS]``, DeepSeek's ``<｜tool▁calls▁begin｜>``, gpt-oss's
``<|channel|>``) are control tokens in real vocabs: LLGuidance matches a
string literal only with ordinary tokens, so it would spell the marker out
byte by byte instead of letting the model write its own token, and a
``<token>`` reference fails to compile on a vocab without that token.
Those families keep the GBNF grammar, whose literals match control tokens.
"""

from __future__ import annotations

import json
from typing import Any

from formats.schema_lark import lark_grammar, lark_json, lark_literal
from supervisor.generation.grammar import MAX_PARALLEL_CALLS

LARK_STYLES: frozenset[str] = frozenset({"hermes", "llama3"})

# One tool for a grammar: (name, JSON schema of its arguments or None, lenient).
LarkTool = tuple[str, dict[str, Any] | None, bool]


def args_json(parameters: dict[str, Any] | None, lenient: bool) -> str:
    """The ``%json`` rule of one tool's arguments: always an object; none
    declared, the empty one."""
    if not parameters:
        return lark_literal("{}")
    schema = parameters if "type" in parameters else {"type": "object", **parameters}
    return lark_json(schema, lenient=lenient)


def _calls(tools: list[LarkTool], key: str) -> dict[str, str]:
    """Rules ``call`` (any one of ``tools``), its alternatives and their arguments."""
    if not tools:
        raise ValueError("a forced call needs at least one tool")
    rules: dict[str, str] = {}
    for i, (name, parameters, lenient) in enumerate(tools):
        rules[f"args_{i}"] = args_json(parameters, lenient)
        head = lark_literal('{"name": ' + json.dumps(name, ensure_ascii=False) + f', "{key}": ')
        rules[f"call_{i}"] = f'{head} args_{i} "}}"'
    rules["call"] = " | ".join(f"call_{i}" for i in range(len(tools)))
    return rules


def _prefixed(prefix: str, root: str) -> str:
    return f"{lark_literal(prefix)} ( {root} )" if prefix else root


def lark_tool_grammar(tools: list[LarkTool], *, style: str, parallel: bool, prefix: str = "") -> str:
    """LLGuidance's grammar forcing calls to one of ``tools`` in ``style``
    (one of :data:`LARK_STYLES`); ``prefix`` as in ``tool_call_grammar``."""
    if style not in LARK_STYLES:
        raise ValueError(f"the {style} call format keeps its GBNF grammar")
    rules = _calls(tools, "parameters" if style == "llama3" else "arguments")
    root = "call"
    if style == "hermes":
        rules["tagged"] = f'{lark_literal("<tool_call>" + chr(10))} call {lark_literal(chr(10) + "</tool_call>")}'
        root = f'tagged ( {lark_literal(chr(10))} tagged ){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else "tagged"
    # Llama 3 takes one call per turn, as in the GBNF grammar.
    return lark_grammar(_prefixed(prefix, root), rules)


def lark_generic_grammar(tools: list[LarkTool], *, keys: tuple[str, str, str], several: bool,
                         answer: str | None, prefix: str = "") -> str:
    """LLGuidance's grammar for llama.cpp's generic format (generic_calls.py):
    one call, ``several`` (up to the cap) or, when ``answer`` (a rule body)
    is given, an answer. ``keys`` are the format's (one call, several, answer)."""
    one_key, some_key, answer_key = keys
    rules = _calls(tools, "arguments")
    ways = ["one_call"]
    rules["one_call"] = f'{lark_literal("{" + json.dumps(one_key) + ": ")} call "}}"'
    if several:
        head = lark_literal("{" + json.dumps(some_key) + ": [")
        rules["some_calls"] = f'{head} call ( ", " call ){{0,{MAX_PARALLEL_CALLS - 1}}} "]}}"'
        ways.append("some_calls")
    if answer is not None:
        rules["answer_value"] = answer
        rules["answer"] = f'{lark_literal("{" + json.dumps(answer_key) + ": ")} answer_value "}}"'
        ways.append("answer")
    return lark_grammar(_prefixed(prefix, " | ".join(ways)), rules)
