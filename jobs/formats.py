"""Dataset row formats and their conversion to canonical chat messages.

Canonical form: ``{"messages": [{"role": ..., "content": ...}, ...]}``. Input
rows may be alpaca, ShareGPT, OpenAI ``messages`` or plain text. Light on
imports: the parent lists :data:`TEMPLATES` for ``GET /api/dataset/templates``.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from typing import Any

Message = dict[str, str]
ROLES = frozenset({"system", "user", "assistant", "tool"})
FORMATS = ("alpaca", "sharegpt", "messages", "text")
_SHAREGPT_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
    "model": "assistant", "bot": "assistant", "system": "system", "tool": "tool",
    "function": "tool", "observation": "tool",
}

TEMPLATES: list[dict[str, Any]] = [
    {
        "format": "messages",
        "description": "OpenAI chat messages; roles system, user, assistant, tool.",
        "example": {"messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris."},
        ]},
    },
    {
        "format": "alpaca",
        "description": "instruction, optional input and system, output.",
        "example": {"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"},
    },
    {
        "format": "sharegpt",
        "description": "conversations of {from, value}; from is human, gpt or system.",
        "example": {"conversations": [
            {"from": "human", "value": "Hi!"}, {"from": "gpt", "value": "Hello! How can I help?"},
        ]},
    },
    {
        "format": "text",
        "description": "plain text: {\"text\": ...} rows, or one row per line of a .txt file.",
        "example": {"text": "The quick brown fox jumps over the lazy dog."},
    },
]
FILE_TYPES = {
    "jsonl": "one JSON object per line (.jsonl, .ndjson)",
    "json": "a JSON array of objects (.json)",
    "csv": "a header row, then one row per line (.csv, .tsv); JSON-valued cells are decoded",
    "parquet": "Parquet (.parquet), when pyarrow is installed",
    "txt": "plain text, one row per non-empty line (.txt)",
}


class RowError(ValueError):
    """Why one row cannot be converted (reported with its line number)."""


def guess_format(row: object) -> str | None:
    if isinstance(row, str):
        return "text"
    if not isinstance(row, dict):
        return None
    convo = row.get("conversations")
    msgs = row.get("messages")
    if isinstance(msgs, list) and msgs and isinstance(msgs[0], dict) and "from" in msgs[0]:
        return "sharegpt"
    if isinstance(msgs, list):
        return "messages"
    if isinstance(convo, list):
        return "sharegpt"
    if "instruction" in row and "output" in row:
        return "alpaca"
    if "text" in row:
        return "text"
    return None


def detect_format(sample: Sequence[object]) -> str | None:
    """The most common guess over a sample of rows (None if nothing fits)."""
    votes = Counter(g for g in (guess_format(r) for r in sample) if g is not None)
    return votes.most_common(1)[0][0] if votes else None


def _text(value: object, what: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        # OpenAI content parts: keep the text parts.
        parts = [p.get("text") for p in value if isinstance(p, dict)]
        if parts and all(isinstance(p, str) for p in parts):
            return "".join(p for p in parts if isinstance(p, str))
    raise RowError(f"{what} must be a string")


def _maybe_json(value: object) -> object:
    # CSV cells arrive as strings; a JSON list inside one is decoded.
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise RowError(f"cell is not valid JSON: {exc.msg}") from exc
    return value


def _from_messages(row: dict[str, Any]) -> list[Message]:
    msgs = _maybe_json(row.get("messages"))
    if not isinstance(msgs, list):
        raise RowError("'messages' must be a list")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise RowError(f"messages[{i}] must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise RowError(f"messages[{i}].role {role!r} is not one of {sorted(ROLES)}")
        out.append({"role": str(role), "content": _text(m.get("content"), f"messages[{i}].content")})
    return out


def _from_sharegpt(row: dict[str, Any]) -> list[Message]:
    key = "conversations" if "conversations" in row else "messages"
    turns = _maybe_json(row.get(key))
    if not isinstance(turns, list):
        raise RowError(f"'{key}' must be a list")
    out = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            raise RowError(f"{key}[{i}] must be an object")
        role = _SHAREGPT_ROLES.get(str(t.get("from", "")).lower())
        if role is None:
            raise RowError(f"{key}[{i}].from {t.get('from')!r} is not a known speaker")
        out.append({"role": role, "content": _text(t.get("value"), f"{key}[{i}].value")})
    return out


def _from_alpaca(row: dict[str, Any]) -> list[Message]:
    instruction = _text(row.get("instruction"), "instruction")
    extra = row.get("input") or ""
    prompt = instruction + ("\n\n" + _text(extra, "input") if extra else "")
    out: list[Message] = []
    if row.get("system"):
        out.append({"role": "system", "content": _text(row["system"], "system")})
    out.append({"role": "user", "content": prompt})
    out.append({"role": "assistant", "content": _text(row.get("output"), "output")})
    return out


def _from_text(row: object) -> list[Message]:
    text = row if isinstance(row, str) else row.get("text") if isinstance(row, dict) else None
    return [{"role": "assistant", "content": _text(text, "text")}]


def to_messages(row: object, fmt: str) -> list[Message]:
    """Convert one row; raises RowError saying what is wrong with it."""
    if fmt != "text" and not isinstance(row, dict):
        raise RowError(f"a {fmt} row must be a JSON object, got {type(row).__name__}")
    if fmt == "messages":
        msgs = _from_messages(row)  # type: ignore[arg-type]
    elif fmt == "sharegpt":
        msgs = _from_sharegpt(row)  # type: ignore[arg-type]
    elif fmt == "alpaca":
        msgs = _from_alpaca(row)  # type: ignore[arg-type]
    elif fmt == "text":
        msgs = _from_text(row)
    else:
        raise ValueError(f"unknown format {fmt}")
    _check(msgs, fmt)
    return msgs


def _check(msgs: list[Message], fmt: str) -> None:
    if not any(m["role"] != "system" for m in msgs):
        raise RowError("no user or assistant message")
    for i, m in enumerate(msgs):
        if m["role"] in ("user", "assistant") and not m["content"].strip():
            raise RowError(f"message {i} ({m['role']}) is empty")
    if fmt != "text" and not any(m["role"] == "assistant" for m in msgs):
        raise RowError("no assistant message")
