"""The job-process side of the job protocol.

A job runs as ``python -m jobs <kind>``. The parent writes one JSON line to the
job's stdin (``{"params": {...}, "context": {...}}``) and keeps the pipe open;
EOF on stdin means the parent is gone and the job exits at once. The job writes
NDJSON events to stdout, one object per line: ``{"type": T, "data": {...}}``
with T one of ``started``, ``log``, ``stage``, ``progress``, ``metric``,
``done``, ``failed``. Exactly one ``done`` (data ``{"result": {...}}``) or
``failed`` (data ``{"error": "..."}``) ends a job. SIGTERM asks the job to
stop at the next step boundary (:attr:`JobIO.stop_requested`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import IO, Any, Literal

import msgspec

EventType = Literal["started", "log", "stage", "progress", "metric", "done", "failed"]


class JobEvent(msgspec.Struct):
    type: EventType
    data: dict[str, Any] = {}


class JobInput(msgspec.Struct):
    params: dict[str, Any]
    context: dict[str, Any] = {}


class JobIO:
    """Reads the job's input, writes its events, watches stdin and SIGTERM."""

    def __init__(self, stdin: IO[bytes] | None = None, stdout: IO[bytes] | None = None) -> None:
        self._stdin = stdin if stdin is not None else sys.stdin.buffer
        self._stdout = stdout if stdout is not None else sys.stdout.buffer
        self._enc = msgspec.json.Encoder()
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def read_input(self) -> JobInput:
        line = self._stdin.readline()
        return msgspec.json.decode(line, type=JobInput)

    def start_watchdogs(self) -> None:
        """Exit when stdin closes; record SIGTERM as a stop request."""
        signal.signal(signal.SIGTERM, lambda _s, _f: self._stop.set())
        threading.Thread(target=self._watch_stdin, name="stdin-watch", daemon=True).start()

    def _watch_stdin(self) -> None:
        # os.read, not the buffered reader: a daemon thread blocked inside it
        # would abort the interpreter at exit.
        fd = self._stdin.fileno()
        while os.read(fd, 65536):
            pass
        # The parent is gone: nobody can record our result, so stop now.
        os._exit(70)

    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    def emit(self, type_: EventType, **data: Any) -> None:
        line = self._enc.encode(JobEvent(type_, data)) + b"\n"
        with self._lock:
            self._stdout.write(line)
            self._stdout.flush()

    def log(self, message: str) -> None:
        self.emit("log", message=message, time=time.time())

    def stage(self, name: str) -> None:
        self.emit("stage", stage=name)

    def progress(self, fraction: float, **extra: Any) -> None:
        self.emit("progress", progress=max(0.0, min(1.0, fraction)), **extra)

    def done(self, result: dict[str, Any]) -> None:
        self.emit("done", result=result)

    def failed(self, error: str) -> None:
        self.emit("failed", error=error)
