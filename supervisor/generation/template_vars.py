"""A request's own chat-template variables: ``chat_template_kwargs``, and
``enable_thinking``, its shortcut for the variable of that name.

Both are llama-server's and vLLM's convention, on chat completions and
Responses alike. The variables reach the template's render beside the
messages; they come after those derived from ``reasoning_effort`` (so they
win), and a model's ``enable_thinking`` setting fills that variable only
when a request sets none (supervisor/workers/pool.py).

They are the client's data inside a sandboxed render, so they are bounded:
names that are identifiers and not the renderer's own, JSON values nested
at most a few levels, a few KiB in all.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from supervisor.errors import BadRequest

FIELD = "chat_template_kwargs"
MAX_BYTES = 16 * 1024
MAX_NAMES = 64
MAX_DEPTH = 4
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}\Z")
# What the renderer passes itself (worker/chat_template.py): a request
# replacing them would change the conversation, not an option of it.
RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                      "raise_exception", "strftime_now"})


def _depth(value: Any, limit: int) -> int:
    """How deeply ``value`` nests (a scalar: 0), counted no further than ``limit + 1``."""
    if limit < 0 or not isinstance(value, (list, dict)):
        return 0
    inner = value.values() if isinstance(value, dict) else value
    return 1 + max((_depth(v, limit - 1) for v in inner), default=0)


def checked_kwargs(kwargs: dict[str, Any] | None, enable_thinking: bool | None) -> dict[str, Any]:
    """The request's template variables; a 400 naming the field when they
    are too large, nest too deeply, use a name a template cannot read or
    the renderer's own, or contradict ``enable_thinking``."""
    out = dict(kwargs or {})
    if len(out) > MAX_NAMES:
        raise BadRequest(f"{FIELD} takes at most {MAX_NAMES} names", param=FIELD)
    for name, value in out.items():
        param = f"{FIELD}.{name}"
        if not _NAME.match(name):
            raise BadRequest(f"{FIELD} names must be identifiers of at most 64 characters, not {name[:80]!r}",
                             param=FIELD)
        if name in RESERVED:
            raise BadRequest(f"{name!r} is set by the server and cannot be passed in {FIELD}", param=param)
        if _depth(value, MAX_DEPTH) > MAX_DEPTH:
            raise BadRequest(f"{param} nests deeper than {MAX_DEPTH} levels", param=param)
    if out and len(msgspec.json.encode(out)) > MAX_BYTES:
        raise BadRequest(f"{FIELD} is over {MAX_BYTES // 1024} KiB as JSON", param=FIELD)
    if enable_thinking is not None:
        given = out.get("enable_thinking")
        if given is not None and given != enable_thinking:
            raise BadRequest(f"enable_thinking is {str(enable_thinking).lower()} but "
                             f"{FIELD}.enable_thinking is {msgspec.json.encode(given).decode()}",
                             param="enable_thinking")
        out["enable_thinking"] = enable_thinking
    return out


def merged_vars(derived: dict[str, object], kwargs: dict[str, Any] | None,
                enable_thinking: bool | None) -> dict[str, Any]:
    """The variables of one render: ``derived`` (from reasoning_effort),
    then the request's own over them."""
    return {**derived, **checked_kwargs(kwargs, enable_thinking)}
