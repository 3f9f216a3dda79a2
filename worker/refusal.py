"""A request the engine refused before its slot began, as a typed ``Error``.

The engine's refusal carries a type (llama.cpp's ``exceed_context_size_error``,
``invalid_request_error``) and a message meant for people. Which part of the
request it refused is told from that type and from what the request carried,
never from the message's words. Every field the worker sets is valid by
construction, so an invalid request was refused for its media (a body the
engine's decoder cannot read: our checks pass any container with the right
magic bytes) or for its grammar (one llama.cpp's parser refuses). When a
request carried both, the engine is asked about the grammar alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from formats.audio import audio_format
from worker.protocol import Error, Generate

# The engine's error types that say which kind of refusal it was.
CONTEXT_EXCEEDED = "exceed_context_size_error"
INVALID_REQUEST = "invalid_request_error"

# The engine's refusal of a grammar run alone (its error object), or None.
GrammarCheck = Callable[[str], dict[str, Any] | None]


def _message(error: dict[str, Any]) -> str:
    return str(error.get("message", "the engine refused the request"))


def rejection(req: Generate, error: dict[str, Any], *, grammar: str | None, n_ctx: int,
              grammar_refusal: GrammarCheck) -> Error:
    """The typed ``Error`` for the engine's refusal ``error`` of ``req``,
    which ran under ``grammar``; ``grammar_refusal`` asks the engine about
    the grammar alone (only when the request also carried media)."""
    kind = error.get("type")
    if kind == CONTEXT_EXCEEDED:
        return Error(req.id, "context_length_exceeded",
                     f"the prompt has {error.get('n_prompt_tokens')} tokens; "
                     f"the model's context is {error.get('n_ctx', n_ctx)}")
    if kind != INVALID_REQUEST:
        return Error(req.id, "invalid_request", _message(error))
    if grammar is not None:
        refused = grammar_refusal(grammar) if req.images else error
        if refused is not None:
            return Error(req.id, "invalid_grammar", f"cannot build the output grammar: {_message(refused)}")
    if req.images:
        # The engine's decoder refuses a corrupt body of either kind with one error.
        if any(audio_format(b) is not None for b in req.images):
            return Error(req.id, "invalid_audio", f"cannot decode an image or audio clip: {_message(error)}")
        return Error(req.id, "invalid_image", f"cannot decode an image: {_message(error)}")
    return Error(req.id, "invalid_request", _message(error))
