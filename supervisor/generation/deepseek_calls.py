"""DeepSeek tool calls.

``<｜tool▁calls▁begin｜>`` then ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>name``
and the arguments in a fenced json block (R1), or ``name<｜tool▁sep｜>{...}``
(V3.1), each closed by ``<｜tool▁call▁end｜>``.
"""

from __future__ import annotations

import re

from supervisor.generation.grammar import (
    DEEPSEEK_CALL_BEGIN,
    DEEPSEEK_CALL_END,
    DEEPSEEK_CALLS_BEGIN,
    DEEPSEEK_CALLS_END,
    DEEPSEEK_SEP,
)
from supervisor.generation.json_calls import call_from, known_name, whole_json_prefix
from supervisor.generation.pieces import ToolCall, held_suffix

# DeepSeek's arguments, fenced as in its template; the fence is optional (V3.1).
_DEEPSEEK_FENCE = re.compile(r"^\s*```(?:json)?\s*\n?(.*?)\n?\s*```\s*$", re.DOTALL)


def _deepseek_call(segment: str, names: frozenset[str]) -> ToolCall | None:
    """``function<｜tool▁sep｜>name`` + fenced arguments, or ``name<｜tool▁sep｜>{...}``."""
    head, sep, rest = segment.partition(DEEPSEEK_SEP)
    if not sep:
        return None
    if head.strip() == "function":
        name, _, args = rest.partition("\n")
    else:
        name, args = head, rest
    fenced = _DEEPSEEK_FENCE.match(args)
    return call_from({"name": name.strip(), "arguments": (fenced.group(1) if fenced else args).strip()}, names)


def parse_deepseek_calls(text: str, names: frozenset[str]) -> list[ToolCall] | None:
    """Calls in ``<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>``; None if any part is not one."""
    body = text.strip().removeprefix(DEEPSEEK_CALLS_BEGIN)
    # Whatever follows the closing marker (an end-of-sentence token) is not part of any call.
    body = body.partition(DEEPSEEK_CALLS_END)[0]
    calls: list[ToolCall] = []
    for segment in body.split(DEEPSEEK_CALL_BEGIN):
        segment = segment.strip()
        if not segment:
            continue
        # The last call of a reply cut by the token limit has no end marker: kept only if whole.
        call = _deepseek_call(segment.removesuffix(DEEPSEEK_CALL_END), names)
        if call is None:
            return None
        calls.append(call)
    return calls or None


def _unfenced(args: str) -> str:
    """Arguments less the opening of their json fence, even one cut short."""
    args = args.strip()
    if "```json".startswith(args):
        return ""
    for fence in ("```json", "```"):
        if args.startswith(fence):
            return args[len(fence) :].strip()
    return args


def partial_deepseek_calls(text: str, names: frozenset[str]) -> list[ToolCall]:
    """DeepSeek calls the output ended inside: whole ones, then the cut one."""
    body = text.strip().removeprefix(DEEPSEEK_CALLS_BEGIN).partition(DEEPSEEK_CALLS_END)[0]
    body = body[: len(body) - held_suffix(body, (DEEPSEEK_CALLS_END,))]
    calls: list[ToolCall] = []
    for segment in [s for s in body.split(DEEPSEEK_CALL_BEGIN) if s.strip()]:
        if segment.rstrip().endswith(DEEPSEEK_CALL_END):
            call = _deepseek_call(segment.rstrip().removesuffix(DEEPSEEK_CALL_END), names)
            if call is None:
                break
            calls.append(call)
            continue
        head, sep, rest = segment.partition(DEEPSEEK_SEP)
        if not sep:
            break
        if head.strip() == "function":
            written, newline, args = rest.partition("\n")
        else:
            written, newline, args = rest.partition("{")
            args = newline + args
        name = known_name(written.strip(), names, whole=bool(newline))
        if name is None:
            break
        args = _unfenced(args)
        args = args[: len(args) - held_suffix(args, ("\n```" + DEEPSEEK_CALL_END, "```" + DEEPSEEK_CALL_END))]
        calls.append(ToolCall(name, whole_json_prefix(args.rstrip()), complete=False))
    return calls
