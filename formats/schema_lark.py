"""JSON schemas inside LLGuidance's Lark grammars.

A grammar that starts with ``%llguidance`` is LLGuidance's (the engine's
grammar engine where the model's vocab allows it); ``%json {schema}`` in it
is a rule whose text is JSON matching the schema, with the counts, lengths,
patterns, formats and bounds that our GBNF converter does not enforce.
Used by the worker for JSON output formats (worker/guidance.py) and by the
parent for forced tool calls (supervisor/generation/lark_calls.py).

Whitespace is fixed (``", "`` and ``": "``, nothing else): with LLGuidance's
default any whitespace is allowed, and a small model can pad forever.
"""

from __future__ import annotations

import json
from typing import Any

HEADER = "%llguidance {}"
# How the JSON is laid out: as json.dumps writes it, no other whitespace.
LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class NotASchema(ValueError):
    """What was given as a JSON schema is not one."""


def lark_json(schema: Any, *, lenient: bool = False) -> str:
    """The ``%json`` rule body for ``schema``; ``lenient`` lets LLGuidance
    ignore the keywords it does not implement instead of refusing the grammar."""
    if schema is False or not isinstance(schema, (dict, bool)):
        raise NotASchema("a JSON schema must be an object (or true)")
    body = dict(schema) if isinstance(schema, dict) else {}
    body["x-guidance"] = {**LAYOUT, **({"lenient": True} if lenient else {})}
    return "%json " + json.dumps(body, ensure_ascii=False)


def lark_literal(text: str) -> str:
    """``text`` as a Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def lark_grammar(start: str, rules: dict[str, str] | None = None) -> str:
    """A whole LLGuidance grammar: the ``start`` rule on the line after the
    header (worker/guidance.py puts its compile check's sentinel there), then ``rules``."""
    lines = [HEADER, f"start: {start}", *(f"{name}: {body}" for name, body in (rules or {}).items())]
    return "\n".join(lines)
