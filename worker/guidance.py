"""JSON output formats through LLGuidance, the engine's own grammar engine.

xllamacpp is built with LLGuidance: a grammar that starts with
``%llguidance`` is a Lark grammar, and ``%json {schema}`` in it enforces a
JSON schema (counts, lengths, patterns, formats, bounds, ``prefixItems``,
``allOf``...) far beyond our GBNF converter (formats/schema_gbnf.py). Two
facts of the engine, measured with xllamacpp 2026.10, shape this module:

- LLGuidance refuses some vocabs: on the tiny SentencePiece-style test vocab
  every token fails ("forced bytes" in the engine's log). Real byte-level BPE
  vocabs work. So the worker probes at load (:func:`vocab_accepts`) and uses
  LLGuidance only where the probe held (``ModelFacts.schema_grammar``).
- A grammar LLGuidance cannot compile (a keyword it does not implement,
  ``uniqueItems``; an unknown ``format``; an unknown type) is not refused:
  the engine logs the error and samples unconstrained. So a grammar is
  compiled once by the engine itself before it is used
  (:class:`CompileCheck`): the same grammar behind a forced sentinel, a few
  tokens long; an output that is not the sentinel means it did not compile.

The grammars themselves are written by formats/schema_lark.py (JSON output
formats) and supervisor/generation/lark_calls.py (forced tool calls); both
put the start rule on the line after the header, where the compile check
puts its sentinel.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from formats.schema_lark import NotASchema, lark_grammar, lark_json

# Forced before the answer in a compile check; no model writes it unforced.
SENTINEL = "~^~^"
# A schema whose answer the probe can check: a key is forced, its value chosen.
_PROBE_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}},
                 "required": ["ok"], "additionalProperties": False}
# Compiled grammars remembered per worker (a client sends the same schema on every turn).
CHECKED_GRAMMARS = 256

# One engine completion: (request body, its cancel) -> (text, the engine's error or None).
Complete = Callable[[dict[str, Any], threading.Event], tuple[str, dict[str, Any] | None]]


class GuidanceRefused(ValueError):
    """LLGuidance cannot compile this JSON schema (the engine's log says why)."""


def json_lark(schema: Any, *, lenient: bool = False) -> str:
    """A Lark grammar for LLGuidance whose whole output is JSON matching ``schema``.

    ``lenient`` lets LLGuidance ignore the keywords it does not implement
    (the parent allows that only when the client did not ask for strict).
    """
    try:
        return lark_grammar(lark_json(schema, lenient=lenient))
    except NotASchema as exc:
        raise GuidanceRefused(str(exc)) from exc


def _behind_sentinel(grammar: str) -> str:
    """``grammar`` (its start rule on the line after the header) with the sentinel forced first."""
    head, _, json_part = grammar.partition("\nstart: ")
    return f'{head}\nstart: "{SENTINEL}" answer\nanswer: {json_part}'


def vocab_accepts(complete: Complete) -> bool:
    """Whether LLGuidance works on this model's vocab: a probe schema's
    answer must be exactly what it allows, and end there."""
    text, error = complete({"prompt": "a", "max_tokens": 16, "temperature": 1.0, "seed": 1,
                            "grammar": json_lark(_PROBE_SCHEMA)}, threading.Event())
    if error is not None:
        return False
    try:
        return json.loads(text) in ({"ok": True}, {"ok": False})
    except json.JSONDecodeError:
        return False


class CompileCheck:
    """Which LLGuidance grammars the engine compiles, each asked once.

    Shared by the request threads, hence the lock; the engine is asked
    outside it, so two requests with new schemas do not wait on each other.
    """

    def __init__(self, complete: Complete, limit: int = CHECKED_GRAMMARS) -> None:
        self._complete = complete
        self._limit = limit
        self._known: OrderedDict[str, bool] = OrderedDict()
        self._lock = threading.Lock()

    def require(self, grammar: str, shared: dict[str, Any], cancelled: threading.Event) -> None:
        """Return when the engine compiles ``grammar``, else raise :class:`GuidanceRefused`.

        The check runs with ``shared``, the request's own prompt (and
        adapter): its prefill is cached in the slot for the request that
        follows. A check cut by ``cancelled`` decides nothing (the request
        then ends cancelled).
        """
        with self._lock:
            known = self._known.get(grammar)
            if known is not None:
                self._known.move_to_end(grammar)
        if known is None:
            text, error = self._complete({**shared, "max_tokens": len(SENTINEL), "temperature": 0.0,
                                          "grammar": _behind_sentinel(grammar), "cache_prompt": True},
                                         cancelled)
            if error is not None or cancelled.is_set():
                # Not the grammar's fault (the prompt is too long, say): the
                # request itself meets the same refusal and reports it.
                return
            known = text.startswith(SENTINEL)
            with self._lock:
                self._known[grammar] = known
                while len(self._known) > self._limit:
                    self._known.popitem(last=False)
        if not known:
            raise GuidanceRefused("LLGuidance cannot compile this JSON schema (an unknown type or format, "
                                  "a keyword it does not implement, or nesting beyond its limits; "
                                  "the model's log says which)")
