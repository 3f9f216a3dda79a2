"""One parent per state dir: an exclusive ``flock`` on ``<state dir>/gpuvisor.lock``.

Two parents on one state dir would share one SQLite file, one jobs dir and
one set of worker sockets, each recovering the other's running jobs as
interrupted. The lock is held for the whole life of ``gpuvisor serve``; the
holder's pid is written into the file, so a second start can say who holds
it, and once it listens its URL too (the CLI's advice names it). ``flock`` ends with the process (even a SIGKILL), so a stale file
never blocks a start; the file is opened close-on-exec, so no worker or job
inherits the lock and keeps it past the parent.

The CLI reads the same lock to learn whether a service runs on a state dir
(``gpuvisor keys add`` says whether auth is now on for it).
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

LOCK_NAME = "gpuvisor.lock"
# A probe (``holder``) holds a shared lock for microseconds; a start that
# meets one tries again this often within this bound before it gives up.
PROBE_RETRIES = 20
PROBE_PAUSE_S = 0.025


class StateDirBusy(Exception):
    """Another process holds the state dir's lock."""

    def __init__(self, state_dir: Path, pid: int | None) -> None:
        self.state_dir = state_dir
        self.pid = pid
        holder = f"pid {pid}" if pid is not None else "another process"
        super().__init__(f"the state dir {state_dir} is in use by another gpuvisor ({holder}): stop it, "
                         "or start this one with another --state-dir")


def lock_path(state_dir: Path) -> Path:
    return state_dir / LOCK_NAME


@dataclass(frozen=True)
class Holder:
    """The service holding a state dir: its pid, and its URL once it listens."""

    pid: int
    url: str | None


def _read_holder(fd: int) -> Holder | None:
    """What the holder wrote; None while it has not written its pid yet (it locks first)."""
    pid, _, url = os.pread(fd, 4096, 0).decode(errors="replace").partition("\n")
    pid, url = pid.strip(), url.strip()
    return Holder(int(pid), url or None) if pid.isdigit() else None


def _read_pid(fd: int) -> int | None:
    found = _read_holder(fd)
    return found.pid if found is not None else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process (a system service): it exists
    return True


class StateLock:
    """The exclusive lock of one state dir, held from ``acquire`` to ``release``."""

    def __init__(self, state_dir: Path, pause: Callable[[float], None] = time.sleep) -> None:
        self.state_dir = state_dir
        self.pause = pause
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock and write our pid, or raise StateDirBusy naming the holder."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_path(self.state_dir), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            self._lock(fd)
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def _lock(self, fd: int) -> None:
        for attempt in range(PROBE_RETRIES):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                # A service holds it, or a CLI probe for an instant: a service
                # has written its pid (it does right after locking).
                pid = _read_pid(fd)
                if attempt + 1 == PROBE_RETRIES or (pid is not None and _alive(pid)):
                    raise StateDirBusy(self.state_dir, pid) from None
            self.pause(PROBE_PAUSE_S)

    def record_url(self, url: str) -> None:
        """Add the URL the service listens on, after its pid."""
        if self._fd is not None:
            os.pwrite(self._fd, f"{os.getpid()}\n{url}\n".encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            # The file stays: removing it would let a third process lock a new
            # file while a second one still waits on the old one's inode.
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> StateLock:
        self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


def holder(state_dir: Path) -> Holder | None:
    """The service running on ``state_dir``, or None when none runs.

    A probe: it takes a shared lock for an instant, which fails only while a
    ``serve`` holds the exclusive one (a start that meets the probe tries
    again); it never creates the file. A service in the instant between its
    lock and its pid counts as not running yet.
    """
    try:
        fd = os.open(lock_path(state_dir), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None  # no service ever ran here
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_holder(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
