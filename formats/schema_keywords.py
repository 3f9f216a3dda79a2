"""Which keywords of a JSON schema an output grammar does not enforce.

Two grammar engines enforce JSON output formats: LLGuidance, the engine's
own, where the model's vocab allows it, and our GBNF converter
(formats/schema_gbnf.py) as the fallback. Each enforces a different subset
of JSON Schema; :func:`unenforced` names, with where in the schema they
are, the validation keywords one of them would leave unchecked, so that a
strict request is refused instead of being silently loosened.

Only validation keywords count: annotations (``title``, ``description``,
``default``, ``examples``...) and keywords unknown to JSON Schema constrain
nothing (a validator ignores them too).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterator
from typing import Any, NamedTuple


# Counts a grammar writes out one copy per unit (LLGuidance does for item
# counts: one maxItems of 10**7 took 84 s of the engine's loop to refuse).
MAX_SCHEMA_COUNT = 10_000
_COUNT_KEYS = frozenset({"minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties"})
_PATTERN_COUNT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


class CountTooLarge(ValueError):
    """A count or a pattern's repetition in a schema is over :data:`MAX_SCHEMA_COUNT`."""


def check_counts(node: Any, path: str = "schema") -> None:
    """Raise :class:`CountTooLarge` naming the first count of ``node`` over the bound."""
    if isinstance(node, dict):
        for key, value in node.items():
            where = f"{path}.{key}"
            if key in _COUNT_KEYS and isinstance(value, int) and value > MAX_SCHEMA_COUNT:
                raise CountTooLarge(f"{where} = {value} is over the limit of {MAX_SCHEMA_COUNT}")
            if key == "pattern" and isinstance(value, str):
                for low, high in _PATTERN_COUNT.findall(value):
                    if max(int(low), int(high or 0)) > MAX_SCHEMA_COUNT:
                        raise CountTooLarge(f"{where} repeats more than {MAX_SCHEMA_COUNT} times")
            check_counts(value, where)
    elif isinstance(node, list):
        for i, item in enumerate(node):
            check_counts(item, f"{path}[{i}]")


class Backend(enum.Enum):
    GBNF = "gbnf"
    LLGUIDANCE = "llguidance"


class Unenforced(NamedTuple):
    """A keyword at ``path`` (a JSON pointer into the schema, "" = its root)."""

    path: str
    keyword: str

    def __str__(self) -> str:
        return f"{self.keyword} at {self.path or '/'}"


# Keywords that hold subschemas: a mapping of them, a list of them, or one.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
               "unevaluatedItems", "unevaluatedProperties", "additionalItems")

# What our GBNF converter enforces (formats/schema_gbnf.py): types, objects
# with their listed properties (no others are written), enum, const, items,
# anyOf, oneOf (as anyOf), local $ref. ``required`` and
# ``additionalProperties`` are checked apart, for the cases it enforces.
_GBNF_ENFORCED = frozenset({"type", "enum", "const", "properties", "items", "anyOf", "oneOf", "$ref",
                            "$defs", "definitions", "required", "additionalProperties"})
# Validation keywords of JSON Schema (2020-12, and the older drafts' spellings).
_VALIDATION = frozenset({
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
    "maxLength", "minLength", "pattern", "format", "maxItems", "minItems", "uniqueItems", "maxContains",
    "minContains", "maxProperties", "minProperties", "required", "dependentRequired", "properties",
    "patternProperties", "additionalProperties", "propertyNames", "items", "prefixItems", "contains",
    "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "dependentSchemas", "unevaluatedItems",
    "unevaluatedProperties", "additionalItems", "dependencies", "$ref", "$dynamicRef", "$defs", "definitions",
})
# What LLGuidance refuses to compile (measured on the engine's build: it
# answers "Unimplemented keys"); unknown formats are refused too.
_LLGUIDANCE_MISSING = frozenset({
    "uniqueItems", "contains", "minContains", "maxContains", "propertyNames", "not", "if", "then", "else",
    "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedItems", "unevaluatedProperties",
    "$dynamicRef",
})
LLGUIDANCE_FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6",
                                "uuid"})


def _pointer(path: str, key: str | int) -> str:
    return f"{path}/{str(key).replace('~', '~0').replace('/', '~1')}"


def _subschemas(node: dict[str, Any], path: str) -> Iterator[tuple[Any, str]]:
    for key in _SCHEMA_MAPS:
        sub = node.get(key)
        if isinstance(sub, dict):
            yield from ((v, _pointer(_pointer(path, key), k)) for k, v in sub.items())
    for key in _SCHEMA_LISTS:
        sub = node.get(key)
        if isinstance(sub, list):
            yield from ((v, _pointer(_pointer(path, key), i)) for i, v in enumerate(sub))
    for key in _SCHEMA_ONE:
        sub = node.get(key)
        if isinstance(sub, dict):
            yield sub, _pointer(path, key)
        elif isinstance(sub, list) and key == "items":  # the older drafts' tuple form
            yield from ((v, _pointer(_pointer(path, key), i)) for i, v in enumerate(sub))


def _gbnf_misses(node: dict[str, Any]) -> Iterator[str]:
    for key in node:
        if key in _VALIDATION and key not in _GBNF_ENFORCED:
            yield key
    props = node.get("properties")
    listed = props if isinstance(props, dict) else {}
    required = node.get("required")
    if isinstance(required, list) and any(k not in listed for k in required):
        # Only listed properties are written: a required one not among them never is.
        yield "required"
    extra = node.get("additionalProperties")
    if isinstance(extra, dict) and extra and not listed:
        # Without listed properties the converter writes any object.
        yield "additionalProperties"
    if isinstance(node.get("items"), list):
        yield "items"


def _llguidance_misses(node: dict[str, Any]) -> Iterator[str]:
    for key in node:
        if key in _LLGUIDANCE_MISSING:
            yield key
    fmt = node.get("format")
    if isinstance(fmt, str) and fmt not in LLGUIDANCE_FORMATS:
        yield "format"


def unenforced(schema: Any, backend: Backend) -> list[Unenforced]:
    """Every validation keyword of ``schema`` that ``backend`` leaves unchecked, in schema order."""
    misses = _gbnf_misses if backend is Backend.GBNF else _llguidance_misses
    found: list[Unenforced] = []
    stack: list[tuple[Any, str, int]] = [(schema, "", 0)]
    while stack:
        node, path, depth = stack.pop()
        if not isinstance(node, dict) or depth > 64:
            continue  # deeper nesting is refused by the converters themselves
        found.extend(Unenforced(path, key) for key in dict.fromkeys(misses(node)))
        stack.extend((sub, where, depth + 1) for sub, where in reversed(list(_subschemas(node, path))))
    return found
