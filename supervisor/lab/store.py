"""The durable job queue: jobs and their events in the parent's SQLite file.

Every state change is one short ``BEGIN IMMEDIATE`` transaction taken through
:meth:`Database.write`; the next job is claimed with ``UPDATE ... RETURNING``.
A partial unique index on the unique key makes "one identical job queued or
running at a time" a database fact rather than a race in Python.

Statuses: queued -> running -> succeeded | failed | cancelled | interrupted;
queued -> cancelled. A job is running only once the runner holds its devices;
while it waits it is queued, with the stage ``waiting for device``. A job
found running at boot becomes ``interrupted``: GPU jobs are not idempotent,
so nothing is silently re-run.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import aiosqlite
import msgspec

from jobs.events import JobEvent, event_type
from supervisor.db import Database
from supervisor.errors import Conflict, NotFound
from supervisor.lab.hub import JobEventHub, StoredEvent
from supervisor.lab.job_process import kill_leftover_group
from supervisor.lab.job_schema import (
    DEFAULT_RETENTION_S,
    FINISHED,
    JOBS_MIGRATIONS,
    JOBS_OWNER_SCHEMA,
    JOBS_SCHEMA,
    WAITING_STAGE,
    Job,
    JobPage,
    Recovery,
    Status,
    Summary,
    first_row,
    list_query,
    new_job_id,
    row_job,
    summarize,
    unique_key,
)

# Re-exported: what the app, the runner and the routes import from the store.
__all__ = [
    "DEFAULT_RETENTION_S", "FINISHED", "JOBS_MIGRATIONS", "JOBS_OWNER_SCHEMA", "JOBS_SCHEMA",
    "WAITING_STAGE", "Job", "JobPage", "JobStore", "Recovery", "Status",
]

_enc = msgspec.json.Encoder()


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
        return row_job(next(iter(rows)))

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
        sql, args = list_query(status, kind, limit, cursor, owner)
        rows = list(await self.db.reader.execute_fetchall(sql, args))
        more = len(rows) > limit
        rows = rows[:limit]
        next_cursor = str(rows[-1]["n"]) if more and rows else None
        return JobPage([row_job(r) for r in rows], next_cursor)

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
                return row_job(next(iter(rows))), True
            rows = await conn.execute_fetchall(
                "SELECT * FROM jobs WHERE unique_key = ? AND status IN ('queued','running')", (key,)
            )
        return row_job(next(iter(rows))), False

    async def next_queued(self, exclude: Collection[str] = ()) -> Job | None:
        """The best queued job (priority desc, then oldest) not in ``exclude``
        (the runner's jobs that wait for their devices); it stays queued."""
        filt = f" AND id NOT IN ({','.join('?' * len(exclude))})" if exclude else ""
        rows = await self.db.reader.execute_fetchall(
            f"SELECT * FROM jobs WHERE status = 'queued'{filt} ORDER BY priority DESC, n LIMIT 1",
            tuple(exclude),
        )
        row = first_row(rows)
        return row_job(row) if row is not None else None

    async def start(self, job_id: str, node: str | None = None) -> Job | None:
        """Move a queued job to running (its devices are held now) on ``node``
        (None: this machine); None when it is no longer queued (cancelled
        while it waited)."""
        async with self.db.write() as conn:
            rows = await conn.execute_fetchall(
                "UPDATE jobs SET status = 'running', attempt = attempt + 1, heartbeat_at = ?, "
                "stage = 'starting', node = ? WHERE id = ? AND status = 'queued' RETURNING *",
                (self.clock(), node, job_id),
            )
            row = first_row(rows)
        return row_job(row) if row is not None else None

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
            row = first_row(rows)
        if row is None:
            raise NotFound(f"no job with id {job_id!r}")
        return row_job(row)

    # ------------------------------------------------------------ events

    async def append_events(self, job_id: str, events: Sequence[JobEvent]) -> list[StoredEvent]:
        """Store a batch in one transaction; updates progress/stage/message."""
        if not events:
            return []
        now = self.clock()
        pairs = [(event_type(e), e.data) for e in events]
        async with self.db.write() as conn:
            stored = await self._append(conn, job_id, pairs, now, summarize(events))
        self.hub.publish(job_id, stored)
        return stored

    async def _append(
        self,
        conn: aiosqlite.Connection,
        job_id: str,
        events: Sequence[tuple[str, dict[str, Any]]],
        now: float,
        summary: Summary = (None, None, None),
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
        progress, stage, message = summary
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
        row = first_row(rows)
        if row is None:
            current = await self.get(job_id)
            raise Conflict(f"job {job_id} is already {current.status}")
        data: dict[str, Any] = {"status": status, "error": error, "exit_code": exit_code}
        stored = await self._append(conn, job_id, [("status", data)], now)
        job = row_job(row)
        job.last_seq = stored[-1].seq
        return job, stored

    async def request_cancel(self, job_id: str) -> Job:
        """Queued: cancelled at once. Running: record the request (the runner
        stops the process). Finished: Conflict, except an already cancelled job."""
        async with self.db.write() as conn:
            rows = await conn.execute_fetchall("SELECT * FROM jobs WHERE id = ?", (job_id,))
            row = first_row(rows)
            if row is None:
                raise NotFound(f"no job with id {job_id!r}", param="id")
            job = row_job(row)
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
            row = first_row(rows)
            if row is None:
                job = await self.get(job_id)
                raise Conflict(f"job {job_id} is {job.status}; only {', '.join(resumable)} jobs resume")
            job = row_job(row)
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
            row = first_row(rows)
        if row is None:
            job = await self.get(job_id)
            raise Conflict(f"job {job_id} is {job.status}; cancel it before deleting")
        return row_job(row)

    async def prune(self, retention_s: float = DEFAULT_RETENTION_S, now: float | None = None) -> list[Job]:
        """Delete finished jobs (and their events) older than the retention
        at ``now`` (default: the store's clock).

        Output files are never touched; the caller may remove the log files.
        """
        cutoff = (self.clock() if now is None else now) - retention_s
        async with self.db.write() as conn:
            rows = await conn.execute_fetchall(
                "DELETE FROM jobs WHERE status NOT IN ('queued','running') AND finished_at < ? "
                "RETURNING *",
                (cutoff,),
            )
        return [row_job(r) for r in rows]

    # ------------------------------------------------------------ boot

    async def recover_at_boot(self) -> Recovery:
        """Running jobs become interrupted; their leftover processes are killed.

        A job is running only once it held its devices, so every running job
        may have run. Queued jobs that were waiting for a device simply wait
        again. The kills come after the commit: they may block on psutil.
        """
        report = Recovery()
        ended: list[tuple[str, list[StoredEvent]]] = []
        leftovers: list[Job] = []
        async with self.db.write() as conn:
            await conn.execute(
                "UPDATE jobs SET stage = NULL, message = NULL "
                "WHERE status = 'queued' AND stage = ?", (WAITING_STAGE,)
            )
            rows = await conn.execute_fetchall("SELECT * FROM jobs WHERE status = 'running'")
            for job in [row_job(r) for r in rows]:
                if job.pid is not None:
                    leftovers.append(job)
                _, stored = await self._finish(
                    conn, job.id, "interrupted", None, "supervisor restarted", None,
                    "interrupted: supervisor restarted",
                )
                ended.append((job.id, stored))
                report.interrupted.append(job.id)
        for job_id, stored in ended:
            self._announce_end(job_id, stored)
        for job in leftovers:
            assert job.pid is not None
            report.killed_pids.extend(await asyncio.to_thread(
                kill_leftover_group, job.pid, job.pgid, job.proc_create_time))
        return report
