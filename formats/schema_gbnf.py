"""JSON schemas as GBNF grammars: the output formats the worker enforces.

A practical subset (types, properties, required, enum, const, items,
anyOf/oneOf, local ``$ref``); anything else falls back to any JSON value of
the right shape. Strings admit no raw control characters (JSON forbids them
unescaped, and strict clients reject them). Whitespace is limited to one
optional space so a model cannot pad forever. Used by the worker for
``json_schema`` / ``json_object`` output and by the parent for forced tool
calls.
"""

from __future__ import annotations

import json
import re
from typing import Any

_BASE_RULES = {
    "ws": '[ ]?',
    "string": r'"\"" ( [^"\\\x7F\x00-\x1F] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} ) )* "\""',
    "integer": '"-"? ( [0-9] | [1-9] [0-9]{1,15} )',
    "number": 'integer ( "." [0-9]{1,16} )? ( [eE] [-+]? [0-9]{1,3} )?',
    "boolean": '"true" | "false"',
    "null": '"null"',
    "value": "object | array | string | number | boolean | null",
    "empty-object": '"{" ws "}"',
    "object": '"{" ws ( string ":" ws value ( "," ws string ":" ws value )* )? ws "}"',
    "array": '"[" ws ( value ( "," ws value )* )? ws "]"',
}


def gbnf_literal(text: str) -> str:
    """``text`` as a GBNF double-quoted literal."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return f'"{escaped}"'


def _json_literal(value: Any) -> str:
    return gbnf_literal(json.dumps(value, ensure_ascii=False))


class SchemaError(ValueError):
    """A schema that is not a JSON schema we can enforce (strict mode)."""


_TYPES = frozenset({"object", "array", "string", "integer", "number", "boolean", "null"})
# Schemas nest no deeper than this (real ones: a handful of levels); deeper
# nesting would exhaust the stack of this converter and of llama.cpp's parser.
MAX_SCHEMA_DEPTH = 64


class SchemaGrammar:
    """Collects GBNF rules converted from JSON schemas.

    ``strict`` refuses what would otherwise fall back to any value (an
    unknown type, a ``$ref`` that resolves nowhere, a property whose schema
    is not an object): an output format the client asked for must not be
    silently loosened.
    """

    def __init__(self, strict: bool = False) -> None:
        self.rules: dict[str, str] = dict(_BASE_RULES)
        self._root_schema: dict[str, Any] = {}
        self._suffix: dict[str, int] = {}
        self._depth = 0
        self.strict = strict

    def _loose(self, why: str) -> str:
        if self.strict:
            raise SchemaError(why)
        return "value"

    def rule_name(self, hint: str) -> str:
        base = re.sub(r"[^a-zA-Z0-9-]+", "-", hint).strip("-").lower() or "r"
        name = base
        # A counter per base name: probing n, n+1, ... for each of thousands
        # of colliding names was quadratic.
        while name in self.rules:
            n = self._suffix.get(base, 1) + 1
            self._suffix[base] = n
            name = f"{base}-{n}"
        return name

    def add(self, hint: str, body: str) -> str:
        name = self.rule_name(hint)
        self.rules[name] = body
        return name

    def schema_rule(self, schema: Any, hint: str, root: dict[str, Any] | None = None) -> str:
        """A rule name matching JSON that satisfies ``schema``."""
        if root is not None:
            self._root_schema = root
        if schema is None or schema is True or schema == {}:
            return "value"
        if not isinstance(schema, dict):
            return self._loose(f"{hint}: a schema must be an object, not {type(schema).__name__}")
        if self._depth >= MAX_SCHEMA_DEPTH:
            raise SchemaError(f"the schema nests more than {MAX_SCHEMA_DEPTH} levels deep")
        self._depth += 1
        try:
            return self._convert(schema, hint)
        finally:
            self._depth -= 1

    def _convert(self, schema: dict[str, Any], hint: str) -> str:
        if "$ref" in schema:
            return self._ref(str(schema["$ref"]), hint)
        if "const" in schema:
            return self.add(hint, _json_literal(schema["const"]))
        if "enum" in schema and isinstance(schema["enum"], list) and schema["enum"]:
            return self.add(hint, " | ".join(_json_literal(v) for v in schema["enum"]))
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list) and schema[key]:
                alts = [self.schema_rule(s, f"{hint}-{i}") for i, s in enumerate(schema[key])]
                return self.add(hint, " | ".join(alts))
        kind = schema.get("type")
        if isinstance(kind, list):
            alts = [self._convert({**schema, "type": k}, f"{hint}-{k}") for k in kind]
            return self.add(hint, " | ".join(alts))
        return self._typed(schema, kind, hint)

    def _typed(self, schema: dict[str, Any], kind: Any, hint: str) -> str:
        if kind == "object" or (kind is None and "properties" in schema):
            return self._object(schema, hint)
        if kind == "array":
            item = self.schema_rule(schema.get("items"), f"{hint}-item")
            return self.add(hint, f'"[" ws ( {item} ( "," ws {item} )* )? ws "]"')
        if kind in ("string", "integer", "number", "boolean", "null"):
            return str(kind)
        if kind is not None and kind not in _TYPES:
            return self._loose(f"{hint}: unknown type {kind!r}")
        return "value"

    def _ref(self, ref: str, hint: str) -> str:
        prefixes = ("#/$defs/", "#/definitions/")
        for prefix in prefixes:
            if ref.startswith(prefix):
                key = ref[len(prefix) :]
                defs = self._root_schema.get(prefix[2:-1], {})
                name = f"ref-{re.sub(r'[^a-zA-Z0-9-]+', '-', key).lower()}"
                if name not in self.rules and key in defs:
                    # Reserve the name first so recursive schemas terminate.
                    self.rules[name] = "value"
                    self.rules[name] = self.schema_rule(defs[key], f"{name}-body")
                return name if name in self.rules else self._loose(f"$ref {ref!r} resolves to nothing")
        return self._loose(f"$ref {ref!r} is not a local #/$defs/ or #/definitions/ reference")

    def _object(self, schema: dict[str, Any], hint: str) -> str:
        props = schema.get("properties")
        if not isinstance(props, dict) or not props:
            return 'empty-object' if schema.get("additionalProperties") is False else "object"
        wanted = set(schema.get("required", []))
        required = [k for k in props if k in wanted]
        optional = [k for k in props if k not in wanted]
        # One rule per key/value pair, referenced by name: the grammar grows
        # linearly with the number of properties.
        pairs = {
            key: self.add(f"{hint}-kv", f"{_json_literal(key)} \":\" ws {self.schema_rule(sub, f'{hint}-{key}')}")
            for key, sub in props.items()
        }
        if required:
            body = ' "," ws '.join(pairs[k] for k in required)
            body += "".join(f' ( "," ws {pairs[k]} )?' for k in optional)
        else:
            body = self._optional_subset([pairs[k] for k in optional], hint)
        return self.add(hint, f'"{{" ws {body} ws "}}"')

    def _optional_subset(self, pairs: list[str], hint: str) -> str:
        """Any ordered subset of ``pairs``, empty included, in O(n) rules:
        tail_i is "what may follow once pair i-1 was written"."""
        tails = [""] * (len(pairs) + 1)
        for i in range(len(pairs) - 1, 0, -1):
            rest = f" {tails[i + 1]}" if tails[i + 1] else ""
            tails[i] = self.add(f"{hint}-tail", f'( "," ws {pairs[i]} )?{rest}')
        firsts = [f"{pair} {tails[i + 1]}".strip() for i, pair in enumerate(pairs)]
        return "( " + " | ".join(firsts) + " )?"

    def render(self, root: str) -> str:
        lines = [f"root ::= {root}"]
        lines += [f"{name} ::= {body}" for name, body in self.rules.items()]
        return "\n".join(lines) + "\n"


def schema_gbnf(schema: Any) -> str:
    """A grammar matching JSON that satisfies ``schema``."""
    g = SchemaGrammar(strict=True)
    root = g.schema_rule(schema, "root-value", root=schema if isinstance(schema, dict) else None)
    return g.render(root)


def json_object_gbnf() -> str:
    """A grammar matching any JSON object."""
    return SchemaGrammar().render("object")
