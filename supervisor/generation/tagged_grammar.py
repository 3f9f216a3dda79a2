"""GBNF grammars forcing calls in the formats of :mod:`tagged_calls`.

:func:`forced_call_grammar` is what a plan asks for a forced call in any
format: the families here, or those of :mod:`grammar` (Hermes, Mistral,
Llama 3, DeepSeek, harmony), which it hands on. Styles (``TaggedStyle``):

- qwen3_coder: ``<tool_call>\\n<function=NAME>\\n<parameter=K>\\nv\\n</parameter>\\n</function>\\n</tool_call>``
- glm45: ``<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call>``
- kimi_k2: ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}
  <|tool_call_end|><|tool_calls_section_end|>``
- functionary_v32: ``>>>NAME\\n{...}``
- command_r7b: ``<|START_ACTION|>[{"tool_call_id": "0", "tool_name": NAME, "parameters": {...}}]<|END_ACTION|>``
- granite: ``<|tool_call|>[{"name": NAME, "arguments": {...}}]``
- nemotron: ``<TOOLCALL>[{"name": NAME, "arguments": {...}}]</TOOLCALL>``

The two XML formats write a parameter's value raw: a string parameter is
its text (one of its enum or const values when it has them; else up to
``MAX_RAW_VALUE`` characters with no ``<``), any other the JSON its schema
takes. Required parameters come first, in the schema's order, then each
optional one or not.
"""

from __future__ import annotations

import json
from typing import Any, Literal, cast, get_args

from formats.schema_gbnf import SchemaGrammar, gbnf_literal
from supervisor.generation import tagged_calls as tc
from supervisor.generation.grammar import MAX_PARALLEL_CALLS, ToolStyle, args_rule, tool_call_grammar

TaggedStyle = Literal["qwen3_coder", "glm45", "kimi_k2", "functionary_v32", "command_r7b", "granite", "nemotron"]
# Every call format a template profile can name.
CallStyle = ToolStyle | TaggedStyle
TAGGED_STYLES: frozenset[str] = frozenset(get_args(TaggedStyle))

# A raw string value: long enough for a path or a query, short enough that a
# model cannot ramble inside one.
MAX_RAW_VALUE = 256

NL = "\n"
# JSON lists of calls: (opening, closing, the object's name and arguments keys).
_LISTS = {
    "command_r7b": (tc.R7B_OPEN + "[", "]" + tc.R7B_CLOSE, "tool_name", "parameters"),
    "granite": (tc.GRANITE_OPEN + "[", "]", "name", "arguments"),
    "nemotron": (tc.NEMOTRON_OPEN + "[", "]" + tc.NEMOTRON_CLOSE, "name", "arguments"),
}


def _raw_value(g: SchemaGrammar, schema: Any, hint: str, root: dict[str, Any] | None) -> str:
    """The rule of one XML parameter value."""
    if not isinstance(schema, dict) or schema.get("type") != "string":
        return g.schema_rule(schema if schema is not None else {}, hint, root=root)
    if "const" in schema and isinstance(schema["const"], str):
        return gbnf_literal(schema["const"])
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return g.add(hint, " | ".join(gbnf_literal(v) for v in enum))
    return g.add(hint, f"[^<]{{0,{MAX_RAW_VALUE}}}")


def _xml_params(g: SchemaGrammar, name: str, params: dict[str, Any] | None, style: str) -> str:
    """The parameters of one XML call (possibly none: ``""``)."""
    props = (params or {}).get("properties")
    if not isinstance(props, dict) or not props:
        return ""
    required = [k for k in (params or {}).get("required", []) if k in props]
    parts: list[str] = []
    for key in [*required, *[k for k in props if k not in required]]:
        value = _raw_value(g, props[key], f"val-{name}-{key}", params)
        if style == "qwen3_coder":
            one = f"{gbnf_literal(f'<parameter={key}>' + NL)} {value} {gbnf_literal(NL + '</parameter>' + NL)}"
        else:
            head = f"<arg_key>{key}</arg_key>\n<arg_value>"
            one = f"{gbnf_literal(head)} {value} {gbnf_literal('</arg_value>' + NL)}"
        parts.append(one if key in required else f"( {one} )?")
    return " ".join(parts)


def _call(g: SchemaGrammar, name: str, params: dict[str, Any] | None, style: TaggedStyle) -> str:
    if style == "qwen3_coder":
        head = gbnf_literal(f"<tool_call>\n<function={name}>\n")
        return f'{head} {_xml_params(g, name, params, style)} {gbnf_literal("</function>" + NL + "</tool_call>")}'
    if style == "glm45":
        head = gbnf_literal(f"<tool_call>{name}\n")
        return f"{head} {_xml_params(g, name, params, style)} {gbnf_literal('</tool_call>')}"
    args = args_rule(g, name, params)
    if style == "kimi_k2":
        return (f"{gbnf_literal(tc.KIMI_CALL_OPEN + 'functions.' + name + ':')} [0-9] "
                f"{gbnf_literal(tc.KIMI_ARGS)} {args} {gbnf_literal(tc.KIMI_CALL_CLOSE)}")
    if style == "functionary_v32":
        return f"{gbnf_literal(tc.FUNCTIONARY_OPEN + name + NL)} {args}"
    _, _, name_key, args_key = _LISTS[style]
    call_id = '"\\"tool_call_id\\": \\"" [0-9] "\\", " ' if style == "command_r7b" else ""
    head = gbnf_literal(f'"{name_key}": {json.dumps(name)}, "{args_key}": ')
    return f'"{{" {call_id}{head} {args} "}}"'


def _tagged_grammar(tools: list[tuple[str, dict[str, Any] | None]], style: TaggedStyle, parallel: bool,
                    prefix: str) -> str:
    g = SchemaGrammar()
    bodies = [g.add(f"call-{name}", _call(g, name, params, style)) for name, params in tools]
    call = g.add("call", " | ".join(bodies))
    sep = ", " if style in _LISTS else "\n"
    calls = f"{call} ( {gbnf_literal(sep)} {call} ){{0,{MAX_PARALLEL_CALLS - 1}}}" if parallel else call
    if style == "kimi_k2":
        calls = f"{gbnf_literal(tc.KIMI_SECTION_OPEN)} {calls} {gbnf_literal(tc.KIMI_SECTION_CLOSE)}"
    elif style in _LISTS:
        opening, closing, _, _ = _LISTS[style]
        calls = f"{gbnf_literal(opening)} {calls} {gbnf_literal(closing)}"
    return g.render(f"{gbnf_literal(prefix)} {calls}" if prefix else calls)


def forced_call_grammar(
    tools: list[tuple[str, dict[str, Any] | None]],
    *,
    style: CallStyle,
    parallel: bool,
    prefix: str = "",
) -> str:
    """GBNF forcing calls to one of ``tools`` in ``style`` (see :func:`tool_call_grammar`)."""
    if not tools:
        raise ValueError("forced_call_grammar needs at least one tool")
    if style in TAGGED_STYLES:
        # The membership test is the narrowing: mypy cannot see it through a frozenset.
        return _tagged_grammar(tools, cast(TaggedStyle, style), parallel, prefix)
    return tool_call_grammar(tools, style=cast(ToolStyle, style), parallel=parallel, prefix=prefix)
