"""Bounds on client-supplied JSON schemas and the grammars built from them.

llama.cpp parses grammars recursively: nesting of about 1,200 groups
overflows the worker's stack (SIGSEGV), and a repetition count of 10**9
exhausts its memory before parsing starts. A client request must never crash
a worker, so both are refused up front as bad requests
(:class:`GrammarRejected`, a ``ValueError``). Our schema converter writes no
counts out, but schemas are still bounded: a client's grammar may be passed
through as it is elsewhere.
"""

from __future__ import annotations

import json
import re
from typing import Any

from formats.schema_gbnf import schema_gbnf
from formats.schema_keywords import CountTooLarge, check_counts

# Half the nesting measured to crash, for headroom on other stacks.
MAX_GRAMMAR_DEPTH = 512
# The engine parses and holds the whole grammar per request.
MAX_GRAMMAR_BYTES = 4 << 20
# Quoted literals and character classes may hold parentheses that are text.
_GBNF_TEXT = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|#[^\n]*')


class GrammarRejected(ValueError):
    pass


def grammar_depth(gbnf: str) -> int:
    """The deepest nesting of parentheses in a GBNF grammar."""
    depth = deepest = 0
    for ch in _GBNF_TEXT.sub("", gbnf):
        if ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth -= 1
    return deepest


def check_grammar(gbnf: str) -> str:
    if len(gbnf) > MAX_GRAMMAR_BYTES:
        raise GrammarRejected(f"the output grammar is {len(gbnf)} bytes (limit {MAX_GRAMMAR_BYTES}); "
                              "use a smaller schema")
    depth = grammar_depth(gbnf)
    if depth > MAX_GRAMMAR_DEPTH:
        raise GrammarRejected(
            f"the output grammar nests {depth} levels deep (limit {MAX_GRAMMAR_DEPTH}); "
            "lower maxLength / maxItems or the repetition counts in patterns")
    return gbnf


def bounded_schema(schema_json: str) -> Any:
    """The JSON schema, its counts bounded, or GrammarRejected saying what
    is wrong. LLGuidance writes item counts out too: one maxItems of 10**7
    took 84 s of the engine's loop to refuse (measured), and it is bounded
    the same way."""
    try:
        schema = json.loads(schema_json)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise GrammarRejected(f"the JSON schema is not valid JSON: {exc}") from exc
    try:
        check_counts(schema)
    except CountTooLarge as exc:
        raise GrammarRejected(str(exc)) from exc
    return schema


def schema_to_grammar(schema_json: str) -> str:
    """GBNF for a JSON schema, or GrammarRejected saying what is wrong."""
    schema = bounded_schema(schema_json)
    try:
        gbnf = schema_gbnf(schema)
    except RecursionError as exc:
        raise GrammarRejected("the JSON schema is nested too deeply") from exc
    return check_grammar(gbnf)
