"""Files a killed parent or job leaves behind, removed at boot and on delete.

A dataset job writes its temporary files beside its outputs with its id in
the name (jobs/dataset.py): the row spill ``.NAME.JOBID.rows.tmp`` (tens of
MB) and the write-then-rename ``.NAME.JOBID.tmp``. The job removes them
itself, but a kill -9 of the job or of the parent leaves them, and nothing
else ever would. Worker sockets in the run dir carry the pid of the parent
that made them (``w<pid>-...sock``, supervisor/workers/process.py); one
parent holds a state dir at a time (supervisor/service/state_lock.py), so a
socket of another pid is stale once this parent starts.

Only names of exactly these shapes are removed, top level only, and symlinks
are never followed: a user's own files in these dirs are never touched.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger("gpuvisor.jobs")

# job ids are "job_" and 16 hex digits (supervisor/lab/job_schema.py).
_JOB_TEMP = re.compile(r"^\..+\.(job_[0-9a-f]{16})(?:\.rows)?\.tmp$")
_WORKER_SOCKET = re.compile(r"^w([0-9]{1,10})-[0-9a-z.-]*\.sock$")


def _entries(folder: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(folder) as it:
            return list(it)
    except FileNotFoundError:
        return []


def _remove(entry: os.DirEntry[str], wanted: int) -> bool:
    """Unlink ``entry`` if it is (without following links) of the ``wanted`` kind."""
    try:
        if stat.S_IFMT(entry.stat(follow_symlinks=False).st_mode) != wanted:
            return False
        os.unlink(entry.path)
    except FileNotFoundError:
        return False  # gone already: what this wanted
    return True


def remove_job_temps(folders: Iterable[Path], job_ids: set[str] | None = None) -> list[str]:
    """Remove job temp files in ``folders``: those of ``job_ids``, or of any
    job when None (at boot, before any job runs). The names removed."""
    removed: list[str] = []
    for folder in folders:
        for entry in _entries(folder):
            m = _JOB_TEMP.match(entry.name)
            if m is None or (job_ids is not None and m.group(1) not in job_ids):
                continue
            if _remove(entry, stat.S_IFREG):
                removed.append(entry.name)
    if removed:
        log.info("removed %d leftover job temp file(s): %s", len(removed), ", ".join(removed[:5]))
    return removed


def remove_stale_sockets(run_dir: Path, own_pid: int) -> list[str]:
    """Remove worker sockets in ``run_dir`` made by a parent other than ``own_pid``."""
    removed: list[str] = []
    for entry in _entries(run_dir):
        m = _WORKER_SOCKET.match(entry.name)
        if m is None or int(m.group(1)) == own_pid:
            continue
        if _remove(entry, stat.S_IFSOCK):
            removed.append(entry.name)
    if removed:
        log.info("removed %d stale worker socket(s) from an earlier run", len(removed))
    return removed
