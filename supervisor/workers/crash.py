"""Why a worker process ended, in words, and what its log said last.

Turns an exit status into a one-line reason (signal, phase, likely cause) and
reads the tail of the worker's log for the crash report; names the log file.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

# How much of a worker's log a crash report carries: enough for faulthandler's
# stack of the crashing thread, small enough to poll (/api/models) every second.
LOG_TAIL_LINES = 20
LOG_TAIL_READ_BYTES = 16 << 10
LOG_TAIL_LINE_CHARS = 300
# faulthandler's first line; its thread stacks follow and may push it out of the tail.
FAULT_MARKER = "Fatal Python error"


@dataclass(frozen=True)
class SignalInfo:
    meaning: str
    native: bool  # raised by the process's own code, not sent from outside
    likely: str | None = None


_SIGNALS: Mapping[str, SignalInfo] = MappingProxyType({
    "SIGSEGV": SignalInfo("segmentation fault", True,
                          "a bug in the engine, or a model file it misreads (the stack is in the log)"),
    "SIGBUS": SignalInfo("bus error", True,
                         "the model file shrank or changed on disk while it was mapped, or the disk failed"),
    "SIGILL": SignalInfo("illegal instruction", True,
                         "this CPU lacks instructions the engine build needs (e.g. AVX2 or AVX-512): "
                         "install an engine build made for this CPU"),
    "SIGFPE": SignalInfo("arithmetic error", True, "a bug in the engine"),
    "SIGABRT": SignalInfo("aborted", True, "the engine stopped at a failed internal check; the log says which"),
    "SIGKILL": SignalInfo("killed from outside", False,
                          "usually the kernel's out-of-memory killer (the kernel log says so); "
                          "try a smaller context or quantization"),
    "SIGTERM": SignalInfo("terminated", False, "something outside gpuvisor stopped it"),
})

LOAD_FAILURE_HINT = ("likely cause: the engine rejects the file (truncated or corrupt, or an architecture "
                     "or quantization this engine build does not support); it is not restarted")


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def crash_reason(signum: int, phase: str) -> str:
    """One line for a worker that died of ``signum`` while ``phase`` (loading, decoding, serving)."""
    name = signal_name(signum)
    info = _SIGNALS.get(name)
    if info is None:
        return f"the model worker crashed: {name} while {phase}"
    verb, where = ("crashed", " in native code") if info.native else ("was killed", "")
    text = f"the model worker {verb}: {name} ({info.meaning}){where} while {phase}"
    return text if info.likely is None else f"{text}; likely cause: {info.likely}"


def exit_is_news(code: int | None, signalled_by_us: bool) -> bool:
    """Whether the exit status says more than what the parent saw: a signal
    it did not send, or a status the worker exited with itself."""
    return code is not None and (code > 0 or (code < 0 and not signalled_by_us))


def exit_reason(code: int | None, phase: str, known: str | None, signalled_by_us: bool) -> str:
    """Why a worker process ended, from its exit status and what the parent saw.

    A signal the parent did not send is the news (it overrides "handshake
    failed" or "IPC stream broken", which are only its consequences); one the
    parent sent (a hang, a stalled load) keeps the parent's own reason.
    """
    if code is not None and code < 0 and not signalled_by_us:
        return crash_reason(-code, phase)
    if code is not None and code > 0:
        # Only the worker itself exits with a status: its log has the traceback.
        return f"the model worker exited with code {code} while {phase} (see its log)"
    return known or f"the model worker exited with code {code} while {phase}"


def load_failure_reason(reason: str | None) -> str:
    return f"{reason or 'the model cannot be loaded'}; {LOAD_FAILURE_HINT}"


def worker_log_path(log_dir: Path, model_id: str, embedding: bool) -> Path:
    """``<log dir>/<model>.log`` (``.embed.log`` for the embedding worker): stdout and stderr."""
    return log_dir / f"{_safe(model_id)}{'.embed' if embedding else ''}.log"


def read_log_tail(path: Path, start: int = 0, lines: int = LOG_TAIL_LINES,
                  max_bytes: int = LOG_TAIL_READ_BYTES) -> str:
    """The last ``lines`` lines a worker wrote to its log after byte ``start``
    (where this process's output began), each cut to LOG_TAIL_LINE_CHARS.

    When faulthandler's "Fatal Python error" line is in the window but above
    those lines (every thread's stack follows it), it leads the tail: it names
    the fatal signal. A missing log is an empty tail.
    """
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            # Rotated since (smaller than where we began): the whole file is this process's.
            origin = start if start <= size else 0
            begin = max(origin, size - max_bytes)
            f.seek(begin)
            data = f.read(max_bytes)
    except FileNotFoundError:
        return ""  # the worker died before writing any log: no tail to show
    all_lines = data.decode("utf-8", errors="replace").splitlines()
    if begin > origin and all_lines:
        all_lines = all_lines[1:]  # the window began mid-line
    all_lines = [ln if len(ln) <= LOG_TAIL_LINE_CHARS else ln[:LOG_TAIL_LINE_CHARS] + "…" for ln in all_lines]
    tail = all_lines[-lines:] if lines > 0 else []
    if not any(ln.startswith(FAULT_MARKER) for ln in tail):
        above = all_lines[:len(all_lines) - len(tail)]
        fault = next((ln for ln in reversed(above) if ln.startswith(FAULT_MARKER)), None)
        if fault is not None:
            tail = [fault, "…", *tail[2:]]  # still `lines` lines in all
    return "\n".join(tail)


def log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0  # not written yet: the next process's output starts at 0


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)

