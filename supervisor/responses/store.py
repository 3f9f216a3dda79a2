"""Stored responses in the parent's SQLite database.

A response is one row (the full Response object as JSON) plus its input items
in order; a background response also keeps every event it streamed, so a
client can attach to it, leave and resume from a sequence number, even after
the service restarted. Both are written in one transaction, so a response is never stored
half-written; background responses are inserted when queued and updated in
place as their status changes. ``previous_response_id`` chains are walked with
one recursive query. A chain whose older links were pruned or deleted simply
starts at the oldest response still stored.
"""

from __future__ import annotations

import json
from typing import Literal

import msgspec

from supervisor.db import Database
from supervisor.errors import NotFound
from supervisor.responses.events import Event
from supervisor.responses.items import Item, decode_item, encode_item
from supervisor.responses.objects import ErrorInfo, ResponseObject

# Migration for supervisor.db.Database: independent of every other table.
RESPONSES_SCHEMA: list[str] = [
    """CREATE TABLE responses (
        id TEXT PRIMARY KEY,
        created_at REAL NOT NULL,
        status TEXT NOT NULL,
        previous_response_id TEXT,
        background INTEGER NOT NULL DEFAULT 0,
        body BLOB NOT NULL
    )""",
    "CREATE INDEX responses_created_at ON responses(created_at)",
    """CREATE TABLE response_input_items (
        response_id TEXT NOT NULL REFERENCES responses(id) ON DELETE CASCADE,
        position INTEGER NOT NULL,
        item_id TEXT NOT NULL,
        item BLOB NOT NULL,
        PRIMARY KEY (response_id, position)
    ) WITHOUT ROWID""",
]

# Migration for supervisor.db.Database, after RESPONSES_SCHEMA: the events of
# background responses, in sequence. ``IF NOT EXISTS`` because the store also
# applies it itself at start (see ResponseStore.ensure_schema).
RESPONSE_EVENTS_SCHEMA: list[str] = [
    """CREATE TABLE IF NOT EXISTS response_events (
        response_id TEXT NOT NULL REFERENCES responses(id) ON DELETE CASCADE,
        seq INTEGER NOT NULL,
        type TEXT NOT NULL,
        data BLOB NOT NULL,
        PRIMARY KEY (response_id, seq)
    ) WITHOUT ROWID""",
]

# Migration for supervisor.db.Database, after RESPONSE_EVENTS_SCHEMA: the API
# key id that created a response (NULL: the admin, auth off, or older rows),
# so that another user key cannot read, follow, cancel or delete it.
RESPONSES_OWNER_SCHEMA: list[str] = ["ALTER TABLE responses ADD COLUMN owner TEXT"]

# The scope filter of a query: NULL scope (admin, auth off) sees every row.
_SCOPED = " AND (? IS NULL OR owner = ?)"

# Deep enough for any real conversation; stops a corrupted cycle.
MAX_CHAIN = 10_000

_CHAIN_SQL = """
WITH RECURSIVE chain(id, prev, depth) AS (
    SELECT id, previous_response_id, 0 FROM responses WHERE id = ?
    UNION ALL
    SELECT r.id, r.previous_response_id, c.depth + 1
    FROM responses r JOIN chain c ON r.id = c.prev
    WHERE c.depth < ?
)
SELECT c.depth AS depth, 0 AS part, i.position AS position, i.item AS data
    FROM chain c JOIN response_input_items i ON i.response_id = c.id
UNION ALL
SELECT c.depth, 1, 0, r.body FROM chain c JOIN responses r ON r.id = c.id
ORDER BY depth DESC, part, position
"""

_UNFINISHED = ("queued", "in_progress")

_body_encoder = msgspec.json.Encoder()
_body_decoder = msgspec.json.Decoder(ResponseObject)


def previous_not_found(response_id: str) -> NotFound:
    return NotFound(
        f"previous response {response_id!r} not found",
        param="previous_response_id",
        code="previous_response_not_found",
    )


_INSERT_EVENT = (
    # A response deleted meanwhile takes no more events (nor fails the writer).
    "INSERT INTO response_events (response_id, seq, type, data)"
    " SELECT ?, ?, ?, ? WHERE EXISTS (SELECT 1 FROM responses WHERE id = ?)"
)


def _failed_event(resp: ResponseObject, seq: int) -> bytes:
    return _body_encoder.encode({"type": "response.failed", "sequence_number": seq, "response": resp})


class ResponseStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def ensure_schema(self) -> None:
        """Create the events table and owner column where the database's migrations predate them
        (the app's migration list is wired separately); a no-op otherwise."""
        async with self._db.write() as conn:
            for sql in RESPONSE_EVENTS_SCHEMA:
                await conn.execute(sql)
            # Likewise the owner column (the app's migrations add it before this runs).
            columns = {row[1] for row in await conn.execute_fetchall("PRAGMA table_info(responses)")}
            if "owner" not in columns:
                for sql in RESPONSES_OWNER_SCHEMA:
                    await conn.execute(sql)

    async def append_events(self, response_id: str, first_seq: int, events: list[Event]) -> None:
        """Store ``events``, numbered from ``first_seq``, in one transaction."""
        if not events:
            return
        async with self._db.write() as conn:
            await conn.executemany(_INSERT_EVENT, [(response_id, first_seq + i, ev.type, ev.data, response_id)
                                                   for i, ev in enumerate(events)])

    async def finish(self, resp: ResponseObject, first_seq: int, events: list[Event]) -> bool:
        """Store a background response's last ``events`` (numbered from
        ``first_seq``) and its final state in one transaction, so a stored
        terminal event always goes with a finished row; False if it was deleted."""
        async with self._db.write() as conn:
            await conn.executemany(_INSERT_EVENT, [(resp.id, first_seq + i, ev.type, ev.data, resp.id)
                                                   for i, ev in enumerate(events)])
            cur = await conn.execute(
                "UPDATE responses SET status = ?, body = ? WHERE id = ?",
                (resp.status, _body_encoder.encode(resp), resp.id),
            )
            return cur.rowcount == 1

    async def events(self, response_id: str, after: int) -> list[Event]:
        """The stored events of a response with a sequence number above ``after``."""
        async with self._db.reader.execute(
            "SELECT type, data FROM response_events WHERE response_id = ? AND seq > ? ORDER BY seq",
            (response_id, after),
        ) as cur:
            return [Event(row[0], bytes(row[1])) for row in await cur.fetchall()]

    async def save(self, resp: ResponseObject, items: list[Item], owner: str | None = None) -> None:
        """Insert a response (created by key ``owner``) and its input items, atomically."""
        async with self._db.write() as conn:
            await conn.execute(
                "INSERT INTO responses (id, created_at, status, previous_response_id, background, body, owner)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (resp.id, resp.created_at, resp.status, resp.previous_response_id, int(resp.background),
                 _body_encoder.encode(resp), owner),
            )
            await conn.executemany(
                "INSERT INTO response_input_items (response_id, position, item_id, item) VALUES (?, ?, ?, ?)",
                [(resp.id, pos, item.id, encode_item(item)) for pos, item in enumerate(items)],
            )

    async def update(self, resp: ResponseObject) -> bool:
        """Rewrite a stored response; False if it was deleted meanwhile."""
        async with self._db.write() as conn:
            cur = await conn.execute(
                "UPDATE responses SET status = ?, body = ? WHERE id = ?",
                (resp.status, _body_encoder.encode(resp), resp.id),
            )
            return cur.rowcount == 1

    async def get(self, response_id: str, scope: str | None = None) -> ResponseObject | None:
        """The response, if it exists and ``scope`` (a key id; None: any) created it."""
        async with self._db.reader.execute("SELECT body FROM responses WHERE id = ?" + _SCOPED,
                                           (response_id, scope, scope)) as cur:
            row = await cur.fetchone()
        return None if row is None else _body_decoder.decode(row[0])

    async def delete(self, response_id: str, scope: str | None = None) -> bool:
        async with self._db.write() as conn:
            cur = await conn.execute("DELETE FROM responses WHERE id = ?" + _SCOPED, (response_id, scope, scope))
            return cur.rowcount == 1

    async def history(self, response_id: str, scope: str | None = None) -> tuple[ResponseObject, list[Item]]:
        """The response ``response_id`` and every item of its chain, oldest first.

        Raises NotFound (``previous_response_not_found``) for an unknown id,
        or one that ``scope`` (a key id) did not create.
        """
        if scope is not None and await self.get(response_id, scope) is None:
            raise previous_not_found(response_id)
        items: list[Item] = []
        newest: ResponseObject | None = None
        async with self._db.reader.execute(_CHAIN_SQL, (response_id, MAX_CHAIN)) as cur:
            async for row in cur:
                if row["part"] == 0:
                    items.append(decode_item(row["data"]))
                    continue
                resp = _body_decoder.decode(row["data"])
                items.extend(resp.output)
                if row["depth"] == 0:
                    newest = resp
        if newest is None:
            raise previous_not_found(response_id)
        return newest, items

    async def input_items(
        self, response_id: str, *, after: str | None, limit: int, order: Literal["asc", "desc"],
        scope: str | None = None,
    ) -> tuple[list[Item], bool]:
        """A page of input items and whether more follow. Raises NotFound."""
        if await self.get(response_id, scope) is None:
            raise NotFound(f"response {response_id!r} not found", param="response_id")
        cmp, direction = (">", "ASC") if order == "asc" else ("<", "DESC")
        params: list[object] = [response_id]
        where = "response_id = ?"
        if after is not None:
            start = await self._position(response_id, after)
            where += f" AND position {cmp} ?"
            params.append(start)
        params.append(limit + 1)
        sql = f"SELECT item FROM response_input_items WHERE {where} ORDER BY position {direction} LIMIT ?"
        async with self._db.reader.execute(sql, params) as cur:
            rows = list(await cur.fetchall())
        items = [decode_item(row[0]) for row in rows[:limit]]
        return items, len(rows) > limit

    async def _position(self, response_id: str, item_id: str) -> int:
        async with self._db.reader.execute(
            "SELECT MIN(position) FROM response_input_items WHERE response_id = ? AND item_id = ?",
            (response_id, item_id),
        ) as cur:
            row = await cur.fetchone()
        if row is None or row[0] is None:
            raise NotFound(f"item {item_id!r} not found in response {response_id!r}", param="after")
        return int(row[0])

    async def prune(self, older_than: float) -> int:
        """Delete finished responses created before ``older_than`` (epoch seconds)."""
        async with self._db.write() as conn:
            cur = await conn.execute(
                "DELETE FROM responses WHERE created_at < ? AND status NOT IN (?, ?)",
                (older_than, *_UNFINISHED),
            )
            return cur.rowcount

    async def unfinished(self) -> list[str]:
        """The ids of the responses stored as queued or running."""
        async with self._db.reader.execute("SELECT id FROM responses WHERE status IN (?, ?)", _UNFINISHED) as cur:
            return [str(row[0]) for row in await cur.fetchall()]

    async def interrupt_unfinished(self, only: list[str] | None = None) -> int:
        """At boot: background responses left queued or running (of ``only``,
        if given) become failed, and their stored events end with that
        ``response.failed``. One transaction: the full disk refuses all or none."""
        where = "r.status IN (?, ?)"
        params: list[object] = list(_UNFINISHED)
        if only is not None:
            # One parameter however many: no limit on SQL variables to meet.
            where += " AND r.id IN (SELECT value FROM json_each(?))"
            params.append(json.dumps(only))
        async with self._db.write() as conn:
            async with conn.execute(
                "SELECT r.body, (SELECT MAX(e.seq) FROM response_events e WHERE e.response_id = r.id)"
                f" FROM responses r WHERE {where}", params
            ) as cur:
                rows = list(await cur.fetchall())
            for row in rows:
                resp = _body_decoder.decode(row[0])
                resp.status = "failed"
                resp.error = ErrorInfo.of("interrupted", "the server restarted while this response ran")
                await conn.execute(
                    "UPDATE responses SET status = ?, body = ? WHERE id = ?",
                    (resp.status, _body_encoder.encode(resp), resp.id),
                )
                seq = 0 if row[1] is None else int(row[1]) + 1
                await conn.execute(_INSERT_EVENT, (resp.id, seq, "response.failed", _failed_event(resp, seq), resp.id))
            return len(rows)
