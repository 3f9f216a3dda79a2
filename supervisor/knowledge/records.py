"""What every knowledge-base record shares: ids, the owner scope, list pages.

Ids and list parameters come from requests and are hostile: each is checked
against its exact shape before it reaches SQL or the disk, and a bad one is
a 400 naming the field.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from supervisor.errors import BadRequest

# Our ids: a prefix and 24 hex digits (96 random bits), as OpenAI's look.
_ID_BODY = re.compile(r"[0-9a-f]{24}")
FILE_PREFIX = "file-"
STORE_PREFIX = "vs_"

# The owner filter: a NULL scope (the admin, or auth off) sees every row; a
# user key sees only rows it made.
SCOPED = " AND (? IS NULL OR owner = ?)"

MAX_LIST_LIMIT = 100


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def checked_id(value: str, prefix: str, param: str) -> str:
    """``value`` when it has the shape of one of our ids, else a 400."""
    if not (len(value) == len(prefix) + 24 and value.startswith(prefix) and _ID_BODY.fullmatch(value[len(prefix):])):
        shown = value[:40] + ("..." if len(value) > 40 else "")
        raise BadRequest(f"{param} {shown!r} is not a valid id (expected {prefix} and 24 hex digits)", param=param)
    return value


def scope_args(scope: str | None) -> tuple[str | None, str | None]:
    return scope, scope


@dataclass(frozen=True)
class PageAsk:
    """A list request: how many, which way by creation time, and after which id."""

    limit: int
    order: Literal["asc", "desc"]
    after: str | None


def page_ask(query: Mapping[str, str], prefix: str, default_limit: int = 20) -> PageAsk:
    """The list parameters of ``query`` (limit 1..100, order asc|desc, after an id)."""
    raw = query.get("limit", str(default_limit))
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIST_LIMIT:
        raise BadRequest(f"limit must be an integer from 1 to {MAX_LIST_LIMIT}", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadRequest("order must be 'asc' or 'desc'", param="order")
    after = query.get("after")
    if after is not None:
        after = checked_id(after, prefix, "after")
    if "before" in query:
        raise BadRequest("before is not supported; page with after", param="before")
    return PageAsk(int(raw), "asc" if order == "asc" else "desc", after)


def page_sql(ask: PageAsk, table: str, anchor: str = "id = ?") -> tuple[str, str]:
    """(the WHERE part that starts after the cursor row, the ORDER BY ...
    LIMIT part), ordered by creation time then insertion order, so rows made
    in the same second page in the order they were made. The first part
    takes the parameters of ``anchor``, which finds the cursor row."""
    op = ">" if ask.order == "asc" else "<"
    cursor = f" AND (created_at, rowid) {op} (SELECT created_at, rowid FROM {table} WHERE {anchor})"
    direction = "ASC" if ask.order == "asc" else "DESC"
    return cursor, f" ORDER BY created_at {direction}, rowid {direction} LIMIT ?"


def page_body(data: list[dict[str, object]], limit: int, id_key: str = "id") -> dict[str, object]:
    """An OpenAI list page from up to ``limit + 1`` rows (the extra one says there is more)."""
    more = len(data) > limit
    data = data[:limit]
    return {"object": "list", "data": data, "first_id": data[0][id_key] if data else None,
            "last_id": data[-1][id_key] if data else None, "has_more": more}
