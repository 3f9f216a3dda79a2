"""The job-process side of the job protocol.

A job runs as ``python -m jobs <kind>``. The parent writes one JSON line to the
job's stdin (``{"params": {...}, "context": {...}}``) and keeps the pipe open;
EOF on stdin means the parent is gone and the job exits at once. The job writes
NDJSON events to stdout, one object per line: ``{"type": T, "data": {...}}``
with T one of ``started``, ``log``, ``stage``, ``progress``, ``metric``,
``done``, ``failed``: the tagged structs below, which the parent decodes once. Exactly one ``done`` (data ``{"result": {...}}``) or
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


class _Event(msgspec.Struct, tag_field="type"):
    """One line of a job's stdout: ``{"type": T, "data": {...}}``.

    ``data`` is stored and streamed as the job wrote it (kinds add fields of
    their own); the properties are the parent's typed view of the fields it
    acts on, ``None`` where the job sent none of that type.
    """

    data: dict[str, Any] = {}

    @property
    def message(self) -> str | None:
        msg = self.data.get("message")
        return msg if isinstance(msg, str) else None


class Started(_Event, tag="started"):
    pass


class Log(_Event, tag="log"):
    pass


class Stage(_Event, tag="stage"):
    @property
    def stage(self) -> str | None:
        name = self.data.get("stage")
        return name if isinstance(name, str) else None


class Progress(_Event, tag="progress"):
    @property
    def fraction(self) -> float | None:
        value = self.data.get("progress")
        if not isinstance(value, int | float):
            return None
        return min(1.0, max(0.0, float(value)))


class Metric(_Event, tag="metric"):
    """An eval loss or a saved checkpoint (``checkpoint``: its path)."""


class Done(_Event, tag="done"):
    @property
    def result(self) -> dict[str, Any]:
        value = self.data.get("result")
        return value if isinstance(value, dict) else {}


class Failed(_Event, tag="failed"):
    @property
    def error(self) -> str:
        return str(self.data.get("error"))


JobEvent = Started | Log | Stage | Progress | Metric | Done | Failed
EVENT_CLASSES: dict[str, type[JobEvent]] = {
    "started": Started, "log": Log, "stage": Stage, "progress": Progress,
    "metric": Metric, "done": Done, "failed": Failed,
}


def event_type(event: JobEvent) -> EventType:
    """The wire tag of an event (``"progress"``, ...)."""
    tag = type(event).__struct_config__.tag
    assert isinstance(tag, str)
    return tag  # type: ignore[return-value]


def make_event(type_: EventType, data: dict[str, Any]) -> JobEvent:
    return EVENT_CLASSES[type_](data)


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
        line = self._enc.encode(make_event(type_, data)) + b"\n"
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
