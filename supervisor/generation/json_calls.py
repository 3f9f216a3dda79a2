"""Tool calls written as JSON: Hermes / Qwen, Llama 3 and Mistral.

- Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  (the parser finds the tags; the body is parsed here)
- Llama 3: ``{"name": ..., "parameters": {...}}`` as the whole output
- Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]`` and the newer
  ``[TOOL_CALLS]name[ARGS]{...}``

Each format has a whole-call reader (None when any part is not a call) and a
reader for output that ended inside a call (whole calls, then the cut one).
"""

from __future__ import annotations

import json
import re
from typing import Any

from supervisor.generation.pieces import ToolCall, held_suffix

MISTRAL_CALLS = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"
MISTRAL_CALL_ID = "[CALL_ID]"


def _encode_arguments(args: Any) -> str | None:
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
        return args
    if isinstance(args, dict):
        return json.dumps(args, ensure_ascii=False)
    return None


def call_from(obj: Any, names: frozenset[str]) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    encoded = _encode_arguments(args)
    return ToolCall(obj["name"], encoded) if encoded is not None else None


def _json_values(text: str) -> list[Any] | None:
    """Every JSON value in ``text``, separated by whitespace or ``;``."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    pos = 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n;,":
            pos += 1
        if pos == len(text):
            return values
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        values.append(value)


def parse_json_calls(text: str, names: frozenset[str]) -> list[ToolCall] | None:
    """Calls written as JSON objects or lists of them; None if any part is not one."""
    values = _json_values(text)
    if not values:
        return None
    calls: list[ToolCall] = []
    for value in values:
        for obj in value if isinstance(value, list) else [value]:
            call = call_from(obj, names)
            if call is None:
                return None
            calls.append(call)
    return calls


def parse_mistral_calls(text: str, names: frozenset[str]) -> list[ToolCall] | None:
    """The text after ``[TOOL_CALLS]``: a JSON list, or ``name[ARGS]{...}`` segments."""
    calls: list[ToolCall] = []
    for segment in text.split(MISTRAL_CALLS):
        segment = segment.strip()
        if not segment:
            continue
        if MISTRAL_ARGS in segment and not segment.startswith(("[", "{")):
            name, _, args = segment.partition(MISTRAL_ARGS)
            # Histories render ``name[CALL_ID]id[ARGS]``; a model may copy that.
            name = name.partition(MISTRAL_CALL_ID)[0]
            call = call_from({"name": name.strip(), "arguments": args.strip()}, names)
            found = [call] if call is not None else None
        else:
            found = parse_json_calls(segment, names)
        if found is None:
            return None
        calls.extend(found)
    return calls or None


# --------------------------------------------------------- calls cut short

_PARTIAL_NAME = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)(")?')
_PARTIAL_ARGS = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def known_name(written: str, names: frozenset[str], *, whole: bool) -> str | None:
    """The tool a name cut short means: itself when ``whole``, else the one tool it starts."""
    if whole:
        return written if written in names else None
    found = [name for name in names if name.startswith(written)]
    return found[0] if len(found) == 1 else None


def _partial_json_call(text: str, names: frozenset[str]) -> ToolCall | None:
    """``{"name": "get_wea`` or ``{"name": "f", "arguments": {"a": 1`` as an incomplete call."""
    found = _PARTIAL_NAME.match(text)
    if found is None:
        return None
    name = known_name(found.group(1), names, whole=found.group(2) is not None)
    if name is None:
        return None
    rest = text[found.end() :]
    key = _PARTIAL_ARGS.match(rest)
    args = rest[key.end() :] if key else ""
    return ToolCall(name, whole_json_prefix(args), complete=False)


def whole_json_prefix(args: str) -> str:
    """``args`` up to the end of a whole JSON value at its start (what follows,
    such as a model's own "id" field or a marker cut short, is not arguments);
    all of it when the output ended inside the value."""
    try:
        _, end = json.JSONDecoder().raw_decode(args)
    except ValueError:
        return args
    return args[:end]


def partial_json_calls(text: str, names: frozenset[str]) -> list[ToolCall]:
    """The calls of JSON text the output ended inside: whole ones, then the cut one."""
    decoder = json.JSONDecoder()
    text = text.strip()
    pos = 1 if text.startswith("[") else 0
    calls: list[ToolCall] = []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n;,":
            pos += 1
        if pos >= len(text):
            return calls
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            partial = _partial_json_call(text[pos:], names)
            return [*calls, partial] if partial is not None else calls
        call = call_from(value, names)
        if call is None:
            return calls
        calls.append(call)


def partial_mistral_calls(text: str, names: frozenset[str]) -> list[ToolCall]:
    """``[TOOL_CALLS]`` text the output ended inside, either form."""
    if text.lstrip().startswith(("[", "{")):
        return partial_json_calls(text, names)
    calls: list[ToolCall] = []
    for segment in [s for s in text.split(MISTRAL_CALLS) if s.strip()]:
        head, sep, args = segment.partition(MISTRAL_ARGS)
        if not sep:
            head = head[: len(head) - held_suffix(head, (MISTRAL_ARGS, MISTRAL_CALL_ID))]
        name = known_name(head.partition(MISTRAL_CALL_ID)[0].strip(), names, whole=bool(sep))
        if name is None:
            break
        whole = call_from({"name": name, "arguments": args.strip()}, names) if sep else None
        calls.append(whole or ToolCall(name, args.strip(), complete=False))
    return calls
