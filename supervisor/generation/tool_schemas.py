"""A forced call's argument schemas against what its grammar enforces.

A forced tool call's grammar holds each tool's arguments to its
``parameters`` schema: through LLGuidance (supervisor/generation/lark_calls.py)
where the model's vocab and the call format allow it, else through our GBNF
converter, which enforces fewer keywords (formats/schema_keywords.py). As for
output formats (output_format.py), a keyword the grammar would leave
unchecked is never dropped silently:

- a tool with ``strict: true``: a 400 naming the tool, the keyword and where
  it is in its parameters;
- otherwise: served, with a warning in the log; LLGuidance is told to
  ignore what it does not implement rather than refuse the grammar.

Shared by chat completions and the Responses API.
"""

from __future__ import annotations

import logging
from typing import Any

from formats.schema_keywords import Backend, CountTooLarge, check_counts, unenforced
from supervisor.errors import BadRequest
from supervisor.generation.lark_calls import LarkTool
from supervisor.generation.tools import FunctionTool

log = logging.getLogger("gpuvisor.tool_schemas")

# Keywords named in one refusal; a schema may repeat one in many places.
_NAMED = 6
_WHY = {
    Backend.GBNF: "enforces tool arguments with the GBNF fallback, which does not enforce",
    Backend.LLGUIDANCE: "enforces tool arguments with LLGuidance, which does not implement",
}


def _missing(fn: FunctionTool, backend: Backend) -> list[str]:
    try:
        return [str(m) for m in unenforced(fn.parameters, backend)]
    except RecursionError as exc:
        raise BadRequest(f"tool {fn.name!r}: its parameters schema is nested too deeply", param="tools",
                         code="invalid_grammar") from exc


def checked_tools(functions: list[FunctionTool], backend: Backend, model: str = "") -> list[LarkTool]:
    """``(name, parameters, lenient)`` for the grammar forcing calls to
    ``functions`` with ``backend``; raises ``BadRequest`` for a strict tool
    whose parameters hold a keyword ``backend`` leaves unchecked (see the
    module doc), and for counts past the grammar's bounds."""
    out: list[LarkTool] = []
    who = f"model '{model}'" if model else "this model"
    for fn in functions:
        params: dict[str, Any] | None = fn.parameters
        if not params:
            out.append((fn.name, None, False))
            continue
        if backend is Backend.LLGUIDANCE:
            # LLGuidance writes counts out: a huge one stalls the engine.
            try:
                check_counts(params, "parameters")
            except (CountTooLarge, RecursionError) as exc:
                raise BadRequest(f"tool {fn.name!r}: {exc}", param="tools", code="invalid_grammar") from exc
        missing = _missing(fn, backend)
        if missing and fn.strict:
            names = ", ".join(missing[:_NAMED]) + (", ..." if len(missing) > _NAMED else "")
            them = "them" if len(missing) > 1 else "it"
            raise BadRequest(f"tool {fn.name!r}: {who} {_WHY[backend]} {names} in its parameters; remove {them}, "
                             f"or set the tool's strict to false to accept arguments that may not satisfy {them}",
                             param="tools", code="unsupported_schema")
        if missing:
            log.warning("%s, tool %s: %s not enforced in the arguments (%s; strict is off)", who, fn.name,
                        ", ".join(missing[:_NAMED]), backend.value)
        out.append((fn.name, params, bool(missing) and backend is Backend.LLGUIDANCE))
    return out
