"""The job tables and the job row: schema, statuses, the :class:`Job` struct,
the list query and the row summary of a batch of events.

The store (:mod:`supervisor.lab.store`) reads and writes these; the schema
lists are what the app's migrations apply.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import aiosqlite
import msgspec

from jobs.events import JobEvent, Log, Progress, Stage
from supervisor.errors import BadRequest

Status = Literal["queued", "running", "succeeded", "failed", "cancelled", "interrupted"]
FINISHED: frozenset[str] = frozenset({"succeeded", "failed", "cancelled", "interrupted"})
ACTIVE: frozenset[str] = frozenset({"queued", "running"})
DEFAULT_RETENTION_S = 14 * 24 * 3600.0
# The stage of a queued job the runner picked that waits for its devices.
WAITING_STAGE = "waiting for device"
# Progress, stage and message of the job row (None: unchanged).
Summary = tuple[float | None, str | None, str | None]

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
# The files cluster nodes hold in their own Hub caches, one row per file a
# download job that named a node wrote there (supervisor/lab/node_files.py).
# The model's first file carries the model's id and its GGUF header as read there.
NODE_FILES_SCHEMA: list[str] = [
    """CREATE TABLE node_files (
        node TEXT NOT NULL,
        local_path TEXT NOT NULL,
        model_id TEXT,
        repo_id TEXT NOT NULL,
        revision TEXT NOT NULL,
        repo_path TEXT NOT NULL,
        size INTEGER NOT NULL,
        header BLOB,
        job_id TEXT NOT NULL,
        recorded_at REAL NOT NULL,
        PRIMARY KEY (node, local_path)
    ) WITHOUT ROWID""",
    "CREATE INDEX node_files_model ON node_files(model_id) WHERE model_id IS NOT NULL",
]
# The cluster node a job started on (NULL: this machine, or not started):
# the runner may move a count of devices to a node, which its params do not say.
JOBS_NODE_SCHEMA: list[str] = [
    "ALTER TABLE jobs ADD COLUMN node TEXT",
]
# The job tables alone, for a database that holds nothing else (tests, benchmarks).
JOBS_MIGRATIONS: list[list[str]] = [JOBS_SCHEMA, JOBS_OWNER_SCHEMA, NODE_FILES_SCHEMA, JOBS_NODE_SCHEMA]

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
    # The cluster node it started on; None for this machine and before it started.
    node: str | None = None

    @property
    def finished(self) -> bool:
        return self.status in FINISHED

    @property
    def named_node(self) -> str | None:
        """The cluster node the job's params name: its ``node``, or the node
        of the devices it names (``node-b/cuda:0``). None for this machine,
        and for a count of devices, whose machine the runner picks when the
        job starts (then recorded in :attr:`node`)."""
        named = self.params.get("node")
        if isinstance(named, str):
            return named
        ids = self.params.get("gpu_ids")
        nodes = {i.split("/", 1)[0] for i in ids if isinstance(i, str) and "/" in i} if isinstance(ids, list) else set()
        # A job runs on one machine (the runner refuses devices of several): one node or none.
        return nodes.pop() if len(nodes) == 1 else None

    def to_api(self, admin: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {"object": "job"}
        for name in self.__struct_fields__:
            if name not in _HIDDEN and (admin or name not in _ADMIN_ONLY):
                out[name] = getattr(self, name)
        # Where it ran once it started; before, where its params send it.
        out["node"] = self.node or self.named_node
        return out


def row_job(row: aiosqlite.Row) -> Job:
    d = dict(row)
    d.pop("n", None)
    d["params"] = json.loads(d["params"])
    d["result"] = json.loads(d["result"]) if d["result"] is not None else None
    return msgspec.convert(d, Job)


def first_row(rows: Iterable[aiosqlite.Row]) -> aiosqlite.Row | None:
    return next(iter(rows), None)


def new_job_id() -> str:
    return "job_" + secrets.token_hex(8)


def unique_key(kind: str, params: dict[str, Any]) -> str:
    canonical = json.dumps(params, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return kind + ":" + hashlib.sha256(canonical.encode()).hexdigest()


def list_query(
    status: Sequence[str], kind: str | None, limit: int, cursor: str | None, owner: str | None
) -> tuple[str, list[Any]]:
    """The SELECT of one page of jobs, newest first (one row more than
    ``limit``: its presence says another page follows)."""
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
            args.append(int(cursor))
        except ValueError as exc:
            raise BadRequest("invalid cursor", param="cursor") from exc
        where.append("n < ?")
    sql = "SELECT * FROM jobs"
    if where:
        sql += " WHERE " + " AND ".join(where)
    args.append(limit + 1)
    return sql + " ORDER BY n DESC LIMIT ?", args


@dataclass
class JobPage:
    jobs: list[Job]
    next_cursor: str | None


@dataclass
class Recovery:
    interrupted: list[str] = field(default_factory=list)
    killed_pids: list[int] = field(default_factory=list)


def summarize(events: Sequence[JobEvent]) -> Summary:
    """The job row's progress, stage and message after ``events``."""
    progress: float | None = None
    stage: str | None = None
    message: str | None = None
    for e in events:
        if isinstance(e, Progress) and e.fraction is not None:
            progress = e.fraction
        if isinstance(e, Stage) and e.stage is not None:
            stage = e.stage
        if isinstance(e, Log | Stage | Progress) and e.message is not None:
            message = e.message[:500]
    return progress, stage, message
