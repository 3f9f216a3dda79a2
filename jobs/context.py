"""What a job module gets besides its params, and how it ends early.

Shared by the parent (which builds the context) and the job process; like
:mod:`jobs.params` it must stay free of heavy imports.
"""

from __future__ import annotations

import msgspec

from jobs.events import JobIO

# Exit codes of ``python -m jobs``: part of the runner contract.
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_STOPPED = 4


class JobContext(msgspec.Struct, kw_only=True):
    job_id: str
    models_dir: str
    datasets_dir: str
    outputs_dir: str
    # Seconds between keepalive lines while a job is busy in one long step.
    keepalive_s: float = 5.0
    # 1 for a job's first run; a resumed job runs again with the same id.
    attempt: int = 1


class JobError(Exception):
    """A clear, expected failure: its message is the job's error."""


class JobStopped(Exception):
    """The job stopped at a step boundary because it was asked to (SIGTERM)."""


def check_stop(io: JobIO, where: str) -> None:
    """Call at step boundaries: raise JobStopped once SIGTERM arrived."""
    if io.stop_requested:
        raise JobStopped(f"stopped on request {where}")
