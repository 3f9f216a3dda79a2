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
import re
from typing import Any, Literal

ToolStyle = Literal["hermes", "mistral", "llama3"]

MAX_PARALLEL_CALLS = 8

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


class SchemaGrammar:
    """Collects GBNF rules converted from JSON schemas."""

    def __init__(self) -> None:
        self.rules: dict[str, str] = dict(_BASE_RULES)
        self._root_schema: dict[str, Any] = {}

    def rule_name(self, hint: str) -> str:
        base = re.sub(r"[^a-zA-Z0-9-]+", "-", hint).strip("-").lower() or "r"
        name, n = base, 1
        while name in self.rules:
            n += 1
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
        if not isinstance(schema, dict) or not schema:
            return "value"
        return self._convert(schema, hint)

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
                return name if name in self.rules else "value"
        return "value"

    def _object(self, schema: dict[str, Any], hint: str) -> str:
        props = schema.get("properties")
        if not isinstance(props, dict) or not props:
            return 'empty-object' if schema.get("additionalProperties") is False else "object"
        required = [k for k in props if k in set(schema.get("required", []))]
        optional = [k for k in props if k not in required]
        pairs = {
            key: f"{_json_literal(key)} \":\" ws {self.schema_rule(sub, f'{hint}-{key}')}"
            for key, sub in props.items()
        }
        body = ' "," ws '.join(pairs[k] for k in required)
        if required:
            body += "".join(f' ( "," ws {pairs[k]} )?' for k in optional)
        elif optional:
            # No required key: any non-empty ordered subset, or nothing.
            alts = []
            for i, key in enumerate(optional):
                tail = "".join(f' ( "," ws {pairs[k]} )?' for k in optional[i + 1 :])
                alts.append(pairs[key] + tail)
            body = "( " + " | ".join(f"( {a} )" for a in alts) + " )?"
        return self.add(hint, f'"{{" ws {body} ws "}}"')

    def render(self, root: str) -> str:
        lines = [f"root ::= {root}"]
        lines += [f"{name} ::= {body}" for name, body in self.rules.items()]
        return "\n".join(lines) + "\n"


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
