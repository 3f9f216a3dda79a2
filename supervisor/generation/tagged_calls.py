"""Tool calls of the template families whose markup is not one JSON object.

The parser (:mod:`parse`) finds the markers; the text between them is read
here. Each format has a whole-call reader (None when any part is not a call)
and a reader for output that ended inside a call (whole calls, then the cut
one, ``complete=False``).

- Qwen3-Coder: ``<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nvalue\\n</parameter>
  ...</function>\\n</tool_call>``; a value is raw text, typed by the tool's schema
- GLM 4.5: ``<tool_call>NAME\\n<arg_key>ARG</arg_key>\\n<arg_value>value</arg_value>
  ...</tool_call>``, typed the same way
- Kimi K2: ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0
  <|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>``
- Functionary v3.2: ``>>>NAME\\n{...}`` per call (``>>>all\\n`` opens plain text)
- Command R7B: ``<|START_ACTION|>[{"tool_call_id": "0", "tool_name": NAME,
  "parameters": {...}}]<|END_ACTION|>``
- Granite: ``<|tool_call|>[{"name": NAME, "arguments": {...}}]`` to the end
- Nemotron: ``<TOOLCALL>[{"name": NAME, "arguments": {...}}]</TOOLCALL>``
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from supervisor.generation.json_calls import (
    call_from,
    known_name,
    parse_json_calls,
    partial_json_calls,
    whole_json_prefix,
)
from supervisor.generation.pieces import ToolCall, held_suffix

# A tool's JSON schema of arguments, by tool name (None: it declares none).
Schemas = Mapping[str, Mapping[str, Any] | None]

KIMI_SECTION_OPEN = "<|tool_calls_section_begin|>"
KIMI_SECTION_CLOSE = "<|tool_calls_section_end|>"
KIMI_CALL_OPEN = "<|tool_call_begin|>"
KIMI_ARGS = "<|tool_call_argument_begin|>"
KIMI_CALL_CLOSE = "<|tool_call_end|>"
FUNCTIONARY_OPEN = ">>>"
FUNCTIONARY_TEXT = "all"
R7B_OPEN = "<|START_ACTION|>"
R7B_CLOSE = "<|END_ACTION|>"
R7B_RESPONSE_MARKERS = ("<|START_RESPONSE|>", "<|END_RESPONSE|>")
R7B_THINKING = ("<|START_THINKING|>", "<|END_THINKING|>")
GRANITE_OPEN = "<|tool_call|>"
NEMOTRON_OPEN = "<TOOLCALL>"
NEMOTRON_CLOSE = "</TOOLCALL>"

_XML_FUNCTION = re.compile(r"\s*<function=([^>\n]*)>(.*?)</function>\s*", re.DOTALL)
_XML_PARAM = re.compile(r"\s*<parameter=([^>\n]*)>\n?(.*?)\n?</parameter>", re.DOTALL)
_GLM_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _typed(value: str, schema: Mapping[str, Any] | None, key: str) -> Any:
    """A raw parameter value as the tool's schema types it: text for a string,
    else the JSON it spells (text when it spells none, for the tool to refuse)."""
    props = (schema or {}).get("properties")
    prop = props.get(key) if isinstance(props, dict) else None
    kind = prop.get("type") if isinstance(prop, dict) else None
    kinds = kind if isinstance(kind, list) else [kind]
    if "string" in kinds and (len(kinds) == 1 or not value.strip()):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def _args_text(pairs: list[tuple[str, str]], schema: Mapping[str, Any] | None) -> str:
    return json.dumps({k.strip(): _typed(v, schema, k.strip()) for k, v in pairs}, ensure_ascii=False)


def _pairs(pattern: re.Pattern[str], text: str) -> tuple[list[tuple[str, str]], str]:
    """The key/value pairs at the start of ``text``, then what follows them."""
    pairs: list[tuple[str, str]] = []
    pos = 0
    while (found := pattern.match(text, pos)) is not None:
        pairs.append((found.group(1), found.group(2)))
        pos = found.end()
    return pairs, text[pos:]


# ------------------------------------------------------ <tool_call> bodies


def xml_body(body: str) -> bool:
    """Whether a ``<tool_call>`` body is Qwen3-Coder's XML, not Hermes's JSON."""
    return body.lstrip().startswith("<function")


def parse_xml_calls(body: str, schemas: Schemas) -> list[ToolCall] | None:
    """Qwen3-Coder's ``<function=NAME><parameter=K>v</parameter></function>`` calls."""
    calls: list[ToolCall] = []
    pos = 0
    while (found := _XML_FUNCTION.match(body, pos)) is not None and found.end() > pos:
        name = found.group(1).strip()
        pairs, rest = _pairs(_XML_PARAM, found.group(2))
        if name not in schemas or rest.strip():
            return None
        calls.append(ToolCall(name, _args_text(pairs, schemas[name])))
        pos = found.end()
    return calls if calls and not body[pos:].strip() else None


def partial_xml_calls(body: str, schemas: Schemas) -> list[ToolCall]:
    """XML calls the output ended inside: the cut call keeps its whole parameters."""
    head, sep, rest = body.lstrip().removeprefix("<function=").partition(">")
    name = known_name(head.strip(), frozenset(schemas), whole=bool(sep))
    if name is None:
        return []
    pairs, _ = _pairs(_XML_PARAM, rest)
    return [ToolCall(name, _open_args(pairs, schemas[name]), complete=False)]


def parse_glm_call(body: str, schemas: Schemas) -> list[ToolCall] | None:
    """GLM 4.5's ``NAME\\n<arg_key>K</arg_key><arg_value>v</arg_value>...``."""
    name, _, rest = body.strip().partition("<arg_key>")
    name = name.strip()
    if name not in schemas:
        return None
    pairs, left = _pairs(_GLM_PAIR, "<arg_key>" + rest if rest else "")
    if left.strip():
        return None
    return [ToolCall(name, _args_text(pairs, schemas[name]))]


def partial_glm_call(body: str, schemas: Schemas) -> list[ToolCall]:
    head, sep, rest = body.lstrip().partition("\n")
    name = known_name(head.partition("<arg_key>")[0].strip(), frozenset(schemas), whole=bool(sep))
    if name is None:
        return []
    pairs, _ = _pairs(_GLM_PAIR, rest)
    return [ToolCall(name, _open_args(pairs, schemas[name]), complete=False)]


def _open_args(pairs: list[tuple[str, str]], schema: Mapping[str, Any] | None) -> str:
    """The whole parameters of a cut call as JSON left open: more were to follow."""
    return _args_text(pairs, schema).removesuffix("}") if pairs else ""


# ------------------------------------------------------------- Kimi K2


def _kimi_call(segment: str, names: frozenset[str]) -> ToolCall | None:
    head, sep, args = segment.partition(KIMI_ARGS)
    if not sep:
        return None
    # "functions.NAME:INDEX"; the index only orders the calls of a turn.
    name = head.strip().removeprefix("functions.").rpartition(":")[0] or head.strip()
    return call_from({"name": name, "arguments": args.strip()}, names)


def _kimi_segments(text: str) -> list[str]:
    body = text.partition(KIMI_SECTION_CLOSE)[0]
    return [s for s in body.split(KIMI_CALL_OPEN) if s.strip()]


def parse_kimi_calls(text: str, names: frozenset[str]) -> list[ToolCall] | None:
    calls: list[ToolCall] = []
    for segment in _kimi_segments(text):
        call = _kimi_call(segment.strip().removesuffix(KIMI_CALL_CLOSE), names)
        if call is None:
            return None
        calls.append(call)
    return calls or None


def partial_kimi_calls(text: str, names: frozenset[str]) -> list[ToolCall]:
    text = text[: len(text) - held_suffix(text, (KIMI_SECTION_CLOSE,))]
    calls: list[ToolCall] = []
    for segment in _kimi_segments(text):
        segment = segment.strip()
        if segment.endswith(KIMI_CALL_CLOSE):
            call = _kimi_call(segment.removesuffix(KIMI_CALL_CLOSE), names)
            if call is None:
                break
            calls.append(call)
            continue
        head, sep, args = segment.partition(KIMI_ARGS)
        written = head.removeprefix("functions.")
        if not sep:
            written = written[: len(written) - held_suffix(written, (KIMI_ARGS,))]
        name = known_name(written.rpartition(":")[0] if ":" in written else written, names,
                          whole=":" in written)
        if name is None:
            break
        args = args[: len(args) - held_suffix(args, (KIMI_CALL_CLOSE,))]
        calls.append(ToolCall(name, whole_json_prefix(args.strip()), complete=False))
    return calls


# ------------------------------------------------------- Functionary v3.2


def parse_functionary_calls(text: str, names: frozenset[str]) -> list[ToolCall] | None:
    """``NAME\\n{...}`` segments, each after a ``>>>`` (the first one's is consumed)."""
    calls: list[ToolCall] = []
    for segment in text.split(FUNCTIONARY_OPEN):
        if not segment.strip():
            continue
        name, sep, args = segment.strip().partition("\n")
        call = call_from({"name": name.strip(), "arguments": args.strip()}, names) if sep else None
        if call is None:
            return None
        calls.append(call)
    return calls or None


def partial_functionary_calls(text: str, names: frozenset[str]) -> list[ToolCall]:
    calls: list[ToolCall] = []
    for segment in [s for s in text.split(FUNCTIONARY_OPEN) if s.strip()]:
        name, sep, args = segment.lstrip().partition("\n")
        whole = call_from({"name": name.strip(), "arguments": args.strip()}, names) if sep else None
        if whole is not None:
            calls.append(whole)
            continue
        known = known_name(name.strip(), names, whole=bool(sep))
        if known is None:
            break
        calls.append(ToolCall(known, whole_json_prefix(args.strip()), complete=False))
    return calls


# ------------------------------------------ JSON lists: R7B, Granite, Nemotron


def _r7b_renamed(value: Any) -> Any:
    """R7B's ``tool_name``/``parameters`` objects as ``name``/``arguments`` ones."""
    if isinstance(value, list):
        return [_r7b_renamed(v) for v in value]
    if isinstance(value, dict) and "tool_name" in value:
        return {"name": value["tool_name"], "arguments": value.get("parameters", {})}
    return value


def _r7b_text(text: str) -> str:
    """R7B's list re-spelt with the keys the JSON readers know."""
    try:
        value = json.loads(text)
    except ValueError:
        # Cut short: rename the keys as written (the reader needs only "name" first).
        return re.sub(r'\{\s*"tool_call_id"\s*:\s*"[^"]*"\s*,\s*"tool_name"', '{"name"', text).replace(
            '"parameters"', '"arguments"')
    return json.dumps(_r7b_renamed(value), ensure_ascii=False)


def parse_list_calls(open_marker: str, text: str, names: frozenset[str]) -> list[ToolCall] | None:
    text = text.strip()
    return parse_json_calls(_r7b_text(text) if open_marker == R7B_OPEN else text, names)


def partial_list_calls(open_marker: str, text: str, names: frozenset[str]) -> list[ToolCall]:
    close = {R7B_OPEN: R7B_CLOSE, NEMOTRON_OPEN: NEMOTRON_CLOSE}.get(open_marker)
    if close is not None:
        text = text[: len(text) - held_suffix(text, (close,))]
    text = text.strip()
    return partial_json_calls(_r7b_text(text) if open_marker == R7B_OPEN else text, names)
