"""How a job ended: the final state the runner records once the job's whole
process group is gone, and the retry of a record the full disk refused."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs.events import Done, Failed
from supervisor.errors import ApiError, StorageFull
from supervisor.lab.active import ActiveJob, RunnerSettings
from supervisor.lab.job_process import describe_exit, log_tail
from supervisor.lab.store import JobStore, Status

log = logging.getLogger("supervisor.lab.runner")


@dataclass(frozen=True)
class Outcome:
    status: Status
    result: dict[str, Any] | None
    error: str | None
    exit_code: int | None


def outcome_of(active: ActiveJob, rc: int, log_path: Path, settings: RunnerSettings) -> Outcome:
    """The final state of a job whose process exited with ``rc``: its own last
    event, else why it was stopped, else its exit and the tail of its log."""
    how = describe_exit(rc)
    terminal = active.terminal
    if isinstance(terminal, Done):
        return Outcome("succeeded", terminal.result, None, rc)
    if active.stop_reason == "cancel":
        return Outcome("cancelled", None, "cancelled on request", rc)
    if active.stop_reason == "shutdown":
        return Outcome("interrupted", None, "supervisor shut down", rc)
    if active.stop_reason == "heartbeat":
        return Outcome("failed", None, f"no events for {settings.heartbeat_timeout_s:.0f} s: killed ({how})", rc)
    if isinstance(terminal, Failed):
        return Outcome("failed", None, terminal.error, rc)
    tail = log_tail(log_path, settings.log_tail_bytes)
    error = f"job process {how} without finishing"
    return Outcome("failed", None, error + (f"; log tail:\n{tail}" if tail else ""), rc)


async def record(store: JobStore, job_id: str, o: Outcome) -> None:
    """Store the final state; StorageFull when the disk refused it."""
    try:
        await store.finish(job_id, o.status, result=o.result, error=o.error, exit_code=o.exit_code)
    except StorageFull:
        raise
    except ApiError as exc:
        # Already finished elsewhere (say, cancelled while still queued).
        log.info("job %s: %s", job_id, exc.message)


async def record_later(store: JobStore, job_id: str, outcome: Outcome) -> None:
    """Retry a final state the full disk refused. Cancelled at shutdown:
    boot recovery then marks the job ``interrupted``."""
    delay = 0.5
    while True:
        await asyncio.sleep(delay)
        try:
            await record(store, job_id, outcome)
        except StorageFull:
            delay = min(delay * 2, 10.0)
            continue
        log.info("job %s: its final state (%s) is saved now", job_id, outcome.status)
        return
