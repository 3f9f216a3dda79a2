"""The durable job queue: jobs and their events in the parent's SQLite file.

Every state change is one short ``BEGIN IMMEDIATE`` transaction taken through
:meth:`Database.write`; the next job is claimed with ``UPDATE ... RETURNING``.
A partial unique index on the unique key makes "one identical job queued or
running at a time" a database fact rather than a race in Python.

Statuses: queued -> running -> succeeded | failed | cancelled | interrupted;
queued -> cancelled. A job found running at boot becomes ``interrupted``: GPU
jobs are not idempotent, so nothing is silently re-run.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import aiosqlite
import msgspec

from supervisor.db import Database
from supervisor.errors import BadRequest, Conflict, NotFound
from supervisor.lab.hub import JobEventHub, StoredEvent
from supervisor.lab.job_process import kill_leftover_group

Status = Literal["queued", "running", "succeeded", "failed", "cancelled", "interrupted"]
FINISHED: frozenset[str] = frozenset({"succeeded", "failed", "cancelled", "interrupted"})
ACTIVE: frozenset[str] = frozenset({"queued", "running"})
DEFAULT_RETENTION_S = 14 * 24 * 3600.0

JOBS_SCHEMA: list[str] = [
    """CREATE TABLE jobs (
        n INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT NOT NULL UNIQUE,
        kind TEXT NOT NULL,
        status TEXT NOT NULL CHECK (status IN
            ('queued','running','succeeded','failed','cancelled','interrupted')),
        priority INTEGER NOT NULL DEFAULT 0,
        params TEXT NOT NULL,
        progress REAL NOT NULL DEFAULT 0,
        stage TEXT,
        message TEXT,
        result TEXT,
        error TEXT,
        attempt INTEGER NOT NULL DEFAULT 0,
        created_at REAL NOT NULL,
        started_at REAL,
        finished_at REAL,
        heartbeat_at REAL,
        pid INTEGER,
        pgid INTEGER,
        proc_create_time REAL,
        exit_code INTEGER,
        cancel_requested_at REAL,
        log_path TEXT,
        unique_key TEXT NOT NULL,
        last_seq INTEGER NOT NULL DEFAULT 0
    )""",
    # At most one identical job queued or running; finished ones may repeat.
    (
        "CREATE UNIQUE INDEX jobs_active_key ON jobs(unique_key) "
        "WHERE status IN ('queued','running')"
    ),
    "CREATE INDEX jobs_queue ON jobs(status, priority DESC, n)",
    "CREATE INDEX jobs_finished ON jobs(finished_at) WHERE finished_at IS NOT NULL",
    """CREATE TABLE job_events (
        job_id TEXT NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
        seq INTEGER NOT NULL,
        time REAL NOT NULL,
        type TEXT NOT NULL,
        data TEXT NOT NULL,
        PRIMARY KEY (job_id, seq)
    ) WITHOUT ROWID""",
]
# The key that submitted the job: its key id, "admin" for the admin token or
# a session, NULL with authentication off. Keys see only their own jobs.
JOBS_OWNER_SCHEMA: list[str] = [
    "ALTER TABLE jobs ADD COLUMN owner TEXT",
    "CREATE INDEX jobs_owner ON jobs(owner, n)",
]
# The job tables alone, for a database that holds nothing else (tests, benchmarks).
JOBS_MIGRATIONS: list[list[str]] = [JOBS_SCHEMA, JOBS_OWNER_SCHEMA]

_enc = msgspec.json.Encoder()
# Fields the API never shows: internal bookkeeping.
_HIDDEN = ("unique_key", "proc_create_time", "last_seq")
# Process and file facts of the machine: shown to admins only.
_ADMIN_ONLY = frozenset({"pid", "pgid", "log_path"})


class Job(msgspec.Struct, kw_only=True):
    id: str
    kind: str
    status: Status
    priority: int
    params: dict[str, Any]
    progress: float
    stage: str | None
    message: str | None
    result: dict[str, Any] | None
    error: str | None
    attempt: int
    created_at: float
    started_at: float | None
    finished_at: float | None
    heartbeat_at: float | None
    pid: int | None
    pgid: int | None
    proc_create_time: float | None
    exit_code: int | None
    cancel_requested_at: float | None
    log_path: str | None
    unique_key: str
    last_seq: int
    owner: str | None = None

    @property
    def finished(self) -> bool:
        return self.status in FINISHED

    def to_api(self, admin: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {"object": "job"}
        for name in self.__struct_fields__:
            if name not in _HIDDEN and (admin or name not in _ADMIN_ONLY):
                out[name] = getattr(self, name)
        return out


def _job(row: aiosqlite.Row) -> Job:
    d = dict(row)
    d.pop("n", None)
    d["params"] = json.loads(d["params"])
    d["result"] = json.loads(d["result"]) if d["result"] is not None else None
    return msgspec.convert(d, Job)


def _first(rows: Iterable[aiosqlite.Row]) -> aiosqlite.Row | None:
    return next(iter(rows), None)


def new_job_id() -> str:
    return "job_" + secrets.token_hex(8)


def unique_key(kind: str, params: dict[str, Any]) -> str:
    canonical = json.dumps(params, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return kind + ":" + hashlib.sha256(canonical.encode()).hexdigest()


@dataclass
class JobPage:
    jobs: list[Job]
    next_cursor: str | None


@dataclass
class Recovery:
    interrupted: list[str] = field(default_factory=list)
    requeued: list[str] = field(default_factory=list)
    killed_pids: list[int] = field(default_factory=list)


class JobStore:
    """All reads and writes of jobs and job events."""

    def __init__(self, db: Database, clock: Callable[[], float] = time.time) -> None:
        self.db = db
        self.clock = clock
        self.hub = JobEventHub()

    # ------------------------------------------------------------ reads

    async def get(self, job_id: str) -> Job:
        rows = await self.db.reader.execute_fetchall("SELECT * FROM jobs WHERE id = ?", (job_id,))
        if not rows:
            raise NotFound(f"no job with id {job_id!r}", param="id")
        return _job(next(iter(rows)))

    async def list_jobs(
        self,
        *,
        status: Sequence[str] = (),
        kind: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
        owner: str | None = None,
    ) -> JobPage:
        """Newest first; ``cursor`` is the previous page's ``next_cursor``;
        ``owner``: only that key's jobs (None: everyone's)."""
        where: list[str] = []
        args: list[Any] = []
        if owner is not None:
            where.append("owner = ?")
            args.append(owner)
        if status:
            where.append(f"status IN ({','.join('?' * len(status))})")
            args.extend(status)
        if kind:
            where.append("kind = ?")
            args.append(kind)
        if cursor:
            try:
                where.append("n < ?")
                args.append(int(cursor))
            except ValueError as exc:
                raise BadRequest("invalid cursor", param="cursor") from exc
        sql = "SELECT * FROM jobs"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY n DESC LIMIT ?"
        args.append(limit + 1)
        rows = list(await self.db.reader.execute_fetchall(sql, args))
        more = len(rows) > limit
        rows = rows[:limit]
        next_cursor = str(rows[-1]["n"]) if more and rows else None
        return JobPage([_job(r) for r in rows], next_cursor)

    async def events_after(self, job_id: str, after_seq: int, limit: int = 1000) -> list[StoredEvent]:
        rows = await self.db.reader.execute_fetchall(
            "SELECT seq, time, type, data FROM job_events WHERE job_id = ? AND seq > ? "
            "ORDER BY seq LIMIT ?",
            (job_id, after_seq, limit),
        )
        return [StoredEvent(r[0], r[1], r[2], json.loads(r[3])) for r in rows]

    # ------------------------------------------------------------ submit / claim

    async def submit(
        self, kind: str, params: dict[str, Any], priority: int = 0, owner: str | None = None
    ) -> tuple[Job, bool]:
        """Queue a job; an identical queued/running one is returned instead.

        Returns ``(job, created)``: created is False for the existing job
        (whoever owns it: the caller decides what another key may see).
        """
        key = unique_key(kind, params)
        async with self.db.write() as conn:
            # One statement in the common case: the partial unique index
            # turns an identical active job into "no row inserted".
            rows = await conn.execute_fetchall(
                "INSERT INTO jobs (id, kind, status, priority, params, created_at, unique_key, owner) "
                "VALUES (?, ?, 'queued', ?, ?, ?, ?, ?) ON CONFLICT (unique_key) "
                "WHERE status IN ('queued','running') DO NOTHING RETURNING *",
                (new_job_id(), kind, priority, json.dumps(params), self.clock(), key, owner),
            )
            if rows:
                return _job(next(iter(rows))), True
            rows = await conn.execute_fetchall(
                "SELECT * FROM jobs WHERE unique_key = ? AND status IN ('queued','running')", (key,)
            )
        return _job(next(iter(rows))), False

    async def claim_next(self, kinds: Iterable[str] | None = None) -> Job | None:
        """Move the best queued job to running (priority desc, then oldest)."""
        filt, args = "", []
        if kinds is not None:
            kinds = list(kinds)
            filt = f" AND kind IN ({','.join('?' * len(kinds))})"
            args = kinds
        async with self.db.write() as conn:
            rows = await conn.execute_fetchall(
                "UPDATE jobs SET status = 'running', attempt = attempt + 1, heartbeat_at = ?, "
                "stage = 'starting' WHERE id = (SELECT id FROM jobs WHERE status = 'queued'"
                f"{filt} ORDER BY priority DESC, n LIMIT 1) RETURNING *",
                (self.clock(), *args),
            )
            row = _first(rows)
        return _job(row) if row is not None else None

    async def set_stage(self, job_id: str, stage: str, message: str | None = None) -> None:
        async with self.db.write() as conn:
            await conn.execute(
                "UPDATE jobs SET stage = ?, message = coalesce(?, message) WHERE id = ?",
                (stage, message, job_id),
            )

    async def mark_running(
        self, job_id: str, *, pid: int, pgid: int, create_time: float | None, log_path: str
    ) -> Job:
        """Record the spawned process (boot recovery kills it by these facts)."""
        now = self.clock()
        async with self.db.write() as conn:
            rows = await conn.execute_fetchall(
                "UPDATE jobs SET pid = ?, pgid = ?, proc_create_time = ?, log_path = ?, "
                "started_at = ?, heartbeat_at = ?, stage = 'started' WHERE id = ? RETURNING *",
                (pid, pgid, create_time, log_path, now, now, job_id),
            )
            row = _first(rows)
        if row is None:
            raise NotFound(f"no job with id {job_id!r}")
        return _job(row)

    async def requeue(self, job_id: str) -> None:
        """Put back a claimed job that never started a process."""
        async with self.db.write() as conn:
            await conn.execute(
                "UPDATE jobs SET status = 'queued', stage = NULL, attempt = max(attempt - 1, 0) "
                "WHERE id = ? AND status = 'running' AND pid IS NULL",
                (job_id,),
            )

    # ------------------------------------------------------------ events

    async def append_events(
        self, job_id: str, events: Sequence[tuple[str, dict[str, Any]]]
    ) -> list[StoredEvent]:
        """Store a batch in one transaction; updates progress/stage/message."""
        if not events:
            return []
        now = self.clock()
        async with self.db.write() as conn:
            stored = await self._append(conn, job_id, events, now)
        self.hub.publish(job_id, stored)
        return stored

    async def _append(
        self,
        conn: aiosqlite.Connection,
        job_id: str,
        events: Sequence[tuple[str, dict[str, Any]]],
        now: float,
    ) -> list[StoredEvent]:
        rows = await conn.execute_fetchall("SELECT last_seq FROM jobs WHERE id = ?", (job_id,))
        if not rows:
            raise NotFound(f"no job with id {job_id!r}")
        seq = int(next(iter(rows))[0])
        stored = []
        for type_, data in events:
            seq += 1
            stored.append(StoredEvent(seq, now, type_, data))
        await conn.executemany(
            "INSERT INTO job_events (job_id, seq, time, type, data) VALUES (?, ?, ?, ?, ?)",
            [(job_id, e.seq, e.time, e.type, _enc.encode(e.data).decode()) for e in stored],
        )
        progress, stage, message = _summarize(stored)
        await conn.execute(
            "UPDATE jobs SET last_seq = ?, heartbeat_at = ?, progress = coalesce(?, progress), "
            "stage = coalesce(?, stage), message = coalesce(?, message) WHERE id = ?",
            (seq, now, progress, stage, message, job_id),
        )
        return stored

    async def touch(self, job_id: str) -> None:
        """Record a keepalive from the job without storing an event."""
        async with self.db.write() as conn:
            await conn.execute("UPDATE jobs SET heartbeat_at = ? WHERE id = ?", (self.clock(), job_id))

    # ------------------------------------------------------------ finishing

    async def finish(
        self,
        job_id: str,
        status: Status,
        *,
        result: dict[str, Any] | None = None,
        error: str | None = None,
        exit_code: int | None = None,
        message: str | None = None,
    ) -> Job:
        """Move an active job to a finished status and add a ``status`` event."""
        if status not in FINISHED:
            raise ValueError(f"{status} is not a finished status")
        async with self.db.write() as conn:
            job, stored = await self._finish(conn, job_id, status, result, error, exit_code, message)
        self._announce_end(job_id, stored)
        return job

    def _announce_end(self, job_id: str, stored: list[StoredEvent]) -> None:
        # Only after the commit: a subscriber must never see an undone change.
        self.hub.publish(job_id, stored)
        self.hub.end(job_id)

    async def _finish(
        self,
        conn: aiosqlite.Connection,
        job_id: str,
        status: Status,
        result: dict[str, Any] | None,
        error: str | None,
        exit_code: int | None,
        message: str | None,
    ) -> tuple[Job, list[StoredEvent]]:
        now = self.clock()
        rows = await conn.execute_fetchall(
            "UPDATE jobs SET status = ?, result = ?, error = ?, exit_code = ?, finished_at = ?, "
            "message = coalesce(?, message), progress = CASE WHEN ? = 'succeeded' THEN 1.0 "
            "ELSE progress END, stage = ? WHERE id = ? AND status IN ('queued','running') "
            "RETURNING *",
            (
                status,
                json.dumps(result) if result is not None else None,
                error,
                exit_code,
                now,
                message,
                status,
                status,
                job_id,
            ),
        )
        row = _first(rows)
        if row is None:
            current = await self.get(job_id)
            raise Conflict(f"job {job_id} is already {current.status}")
        data: dict[str, Any] = {"status": status, "error": error, "exit_code": exit_code}
        stored = await self._append(conn, job_id, [("status", data)], now)
        job = _job(row)
        job.last_seq = stored[-1].seq
        return job, stored

    async def request_cancel(self, job_id: str) -> Job:
        """Queued: cancelled at once. Running: record the request (the runner
        stops the process). Finished: Conflict, except an already cancelled job."""
        async with self.db.write() as conn:
            rows = await conn.execute_fetchall("SELECT * FROM jobs WHERE id = ?", (job_id,))
            row = _first(rows)
            if row is None:
                raise NotFound(f"no job with id {job_id!r}", param="id")
            job = _job(row)
            if job.status == "queued":
                job, stored = await self._finish(
                    conn, job_id, "cancelled", None, "cancelled before it started", None, None
                )
            elif job.status == "running":
                if job.cancel_requested_at is None:
                    job.cancel_requested_at = self.clock()
                    await conn.execute(
                        "UPDATE jobs SET cancel_requested_at = ?, message = 'cancelling' WHERE id = ?",
                        (job.cancel_requested_at, job_id),
                    )
                return job
            elif job.status != "cancelled":
                raise Conflict(f"job {job_id} is already {job.status}")
            else:
                return job
        self._announce_end(job_id, stored)
        return job

    async def reopen(self, job_id: str) -> Job:
        """Queue a stopped job again, as a new attempt of the same job.

        For resumable kinds: an interrupted, cancelled or failed job keeps
        its id, params, events and output dir, so the job process finds its
        own checkpoints and the event stream (a loss curve) continues.
        """
        resumable = ("interrupted", "cancelled", "failed")
        async with self.db.write() as conn:
            try:
                rows = await conn.execute_fetchall(
                    "UPDATE jobs SET status = 'queued', stage = NULL, message = 'resume requested', "
                    "result = NULL, error = NULL, exit_code = NULL, finished_at = NULL, "
                    "cancel_requested_at = NULL, pid = NULL, pgid = NULL, proc_create_time = NULL "
                    f"WHERE id = ? AND status IN ({','.join('?' * len(resumable))}) RETURNING *",
                    (job_id, *resumable),
                )
            except sqlite3.IntegrityError:
                raise Conflict(f"an identical job is already queued or running; not resuming {job_id}") from None
            row = _first(rows)
            if row is None:
                job = await self.get(job_id)
                raise Conflict(f"job {job_id} is {job.status}; only {', '.join(resumable)} jobs resume")
            job = _job(row)
            data = {"status": "queued", "resumed": True, "attempt": job.attempt + 1}
            stored = await self._append(conn, job_id, [("status", data)], self.clock())
        job.last_seq = stored[-1].seq
        self.hub.publish(job_id, stored)
        return job

    async def delete(self, job_id: str) -> Job:
        """Delete a finished job and its events (409 while active)."""
        async with self.db.write() as conn:
            rows = await conn.execute_fetchall(
                "DELETE FROM jobs WHERE id = ? AND status NOT IN ('queued','running') RETURNING *",
                (job_id,),
            )
            row = _first(rows)
        if row is None:
            job = await self.get(job_id)
            raise Conflict(f"job {job_id} is {job.status}; cancel it before deleting")
        return _job(row)

    async def prune(self, retention_s: float = DEFAULT_RETENTION_S) -> list[Job]:
        """Delete finished jobs (and their events) older than the retention.

        Output files are never touched; the caller may remove the log files.
        """
        cutoff = self.clock() - retention_s
        async with self.db.write() as conn:
            rows = await conn.execute_fetchall(
                "DELETE FROM jobs WHERE status NOT IN ('queued','running') AND finished_at < ? "
                "RETURNING *",
                (cutoff,),
            )
        return [_job(r) for r in rows]

    # ------------------------------------------------------------ boot

    async def recover_at_boot(self) -> Recovery:
        """Running jobs become interrupted; their leftover processes are killed.

        A job claimed but never started (no pid) goes back to the queue: it
        never ran, so running it now is not a silent re-run.
        """
        report = Recovery()
        ended: list[tuple[str, list[StoredEvent]]] = []
        async with self.db.write() as conn:
            rows = await conn.execute_fetchall("SELECT * FROM jobs WHERE status = 'running'")
            jobs = [_job(r) for r in rows]
            for job in jobs:
                if job.pid is None:
                    await conn.execute(
                        "UPDATE jobs SET status = 'queued', stage = NULL WHERE id = ?", (job.id,)
                    )
                    report.requeued.append(job.id)
                    continue
                report.killed_pids.extend(kill_leftover_group(job.pid, job.pgid, job.proc_create_time))
                _, stored = await self._finish(
                    conn, job.id, "interrupted", None, "supervisor restarted", None,
                    "interrupted: supervisor restarted",
                )
                ended.append((job.id, stored))
                report.interrupted.append(job.id)
        for job_id, stored in ended:
            self._announce_end(job_id, stored)
        return report


def _summarize(events: Sequence[StoredEvent]) -> tuple[float | None, str | None, str | None]:
    progress: float | None = None
    stage: str | None = None
    message: str | None = None
    for e in events:
        if e.type == "progress" and isinstance(e.data.get("progress"), int | float):
            progress = min(1.0, max(0.0, float(e.data["progress"])))
        if e.type == "stage" and isinstance(e.data.get("stage"), str):
            stage = e.data["stage"]
        msg = e.data.get("message")
        if e.type in ("log", "stage", "progress") and isinstance(msg, str):
            message = msg[:500]
    return progress, stage, message
