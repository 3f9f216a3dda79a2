"""A JSON-schema output format against what the model's grammar enforces.

The worker enforces a ``json_schema`` output format with LLGuidance where
the model's vocab allows it (``ModelFacts.schema_grammar``), else with our GBNF
converter, which enforces fewer keywords (formats/schema_keywords.py). A
keyword the chosen grammar would leave unchecked is never dropped silently:

- strict (the client set ``strict: true``): a 400 naming the keyword and
  where it is, with ``param`` the schema's field in the client's API;
- otherwise: served, with a warning in the log, and LLGuidance told to
  ignore what it does not implement rather than refuse the schema
  (``SamplingParams.json_lenient``).

Shared by chat completions and the Responses API.
"""

from __future__ import annotations

import json
import logging

from formats.schema_keywords import Backend, unenforced
from supervisor.errors import BadRequest
from worker.protocol import ModelFacts, SamplingParams

log = logging.getLogger("gpuvisor.output_format")

_BACKENDS = {"gbnf": Backend.GBNF, "llguidance": Backend.LLGUIDANCE}
# Keywords named in one refusal; a schema may repeat one in many places.
_NAMED = 6
_WHY = {
    Backend.GBNF: "enforces JSON schemas with the GBNF fallback (LLGuidance does not accept its vocab), "
                  "which does not enforce",
    Backend.LLGUIDANCE: "enforces JSON schemas with LLGuidance, which does not implement",
}


def enforce_format(schema: str | None, params: SamplingParams, facts: ModelFacts, *, generic_answer: bool,
                   strict: bool, param: str, model: str) -> None:
    """Check the output format ``schema`` (JSON text, as the request gave
    it) of a planned generation whose sampling is ``params``.

    The plan may have replaced the format: a forced tool call leaves no
    room for it (nothing to check), and the generic tool-call format of a
    template without tools holds the answer's schema in its own GBNF
    (``generic_answer``: as LLGuidance's ``%json`` where the vocab takes
    it, lenient only where it must be, generic_calls.py). Raises
    ``BadRequest`` naming ``param``.
    """
    if schema is None:
        return
    if params.json_schema is not None and params.grammar is None:
        if facts.schema_grammar not in _BACKENDS:
            return  # the engine's own structured outputs (vLLM's): its subset is its own
        backend = _BACKENDS[facts.schema_grammar]
        params.json_lenient = backend is Backend.LLGUIDANCE and not strict
    elif generic_answer:
        # The generic format's grammar holds the answer: LLGuidance's where the vocab takes it.
        backend = Backend.LLGUIDANCE if (params.grammar or "").startswith("%llguidance") else Backend.GBNF
    else:
        return
    try:
        missing = unenforced(json.loads(schema), backend)
    except RecursionError as exc:
        raise BadRequest("the JSON schema is nested too deeply", param=param, code="invalid_grammar") from exc
    if not missing:
        return
    names = ", ".join(str(m) for m in missing[:_NAMED]) + (", ..." if len(missing) > _NAMED else "")
    if strict:
        raise BadRequest(f"model '{model}' {_WHY[backend]} {names}; remove {'them' if len(missing) > 1 else 'it'} "
                         "from the schema, or set strict to false to accept output that may not satisfy "
                         f"{'them' if len(missing) > 1 else 'it'}", param=param, code="unsupported_schema")
    log.warning("model %s: the output format's %s %s not enforced (%s; strict is off)", model, names,
                "are" if len(missing) > 1 else "is", backend.value)
