"""Repair of a tool call's JSON where the repair cannot change its meaning.

Used only for a call the model closed itself (its closing marker was
written, e.g. ``</tool_call>``): output cut by the token limit or a stop
string is an incomplete call instead, never "repaired" into a whole one.

Two repairs, nothing else:
- a trailing comma before ``}`` or ``]`` (``{"a": 1,}``) is dropped;
- closing braces and brackets missing at the very end are added, when the
  text ends right after a whole value (``{"a": {"b": 1}`` gets one ``}``).

Refused, so the call stays text: a string left open (a value cut short
could mean anything), text ending on ``,`` or ``:`` or inside a key (what
was to follow is unknown), a closer that does not match its opener, and
anything that is still not JSON after the two repairs.
"""

from __future__ import annotations

import json
from typing import NamedTuple

# Nesting deeper than this is refused rather than tracked.
MAX_DEPTH = 256
_CLOSER = {"{": "}", "[": "]"}


class Repaired(NamedTuple):
    text: str
    # What was done, for the log: "trailing comma", "closed 2".
    what: str


def repair_json(text: str) -> Repaired | None:
    """``text`` made JSON by the safe repairs; None when it needs none or another."""
    out: list[str] = []
    stack: list[str] = []
    in_string = escaped = False
    commas = 0
    # The last character outside strings that is not whitespace.
    last = ""
    for ch in text:
        if in_string:
            out.append(ch)
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                last = '"'
            continue
        if ch in "}]":
            if not stack or _CLOSER[stack.pop()] != ch:
                return None
            if last == ",":
                _drop_last_comma(out)
                commas += 1
        elif ch in "{[":
            stack.append(ch)
            if len(stack) > MAX_DEPTH:
                return None
        elif ch == '"':
            in_string = True
        out.append(ch)
        if not ch.isspace():
            last = ch
    if in_string or last in (",", ":", "{", "[", ""):
        # An open "{" or "[" at the end could be closed, but an empty value
        # written in full is rarer than one the model never got to.
        return None
    closers = "".join(_CLOSER[c] for c in reversed(stack))
    fixed = "".join(out) + closers
    try:
        json.loads(fixed)
    except ValueError:
        return None
    what = ", ".join(p for p in (f"{commas} trailing comma(s)" if commas else "",
                                 f"closed {closers}" if closers else "") if p)
    return Repaired(fixed, what) if what else None


def _drop_last_comma(out: list[str]) -> None:
    for i in range(len(out) - 1, -1, -1):
        if out[i] == ",":
            del out[i]
            return
