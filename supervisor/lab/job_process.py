"""Parent-side helpers for one job process: its NDJSON framing and its group.

:class:`EventFramer` turns stdout chunks into events. A line longer than the
bound is dropped (and reported as a ``log`` event), a malformed line becomes a
``log`` event, and a blank line is a keepalive: nothing a job writes can crash
the parent.

The process-group helpers signal a whole group and wait until it is gone;
members that are zombies (exited, not yet reaped by init) count as gone.

:func:`child_environ` is what a model worker or job inherits of the parent's
environment: an allowlist, so the admin token (``GPUVISOR_*``), Hugging Face
and cloud credentials and ``NOTIFY_SOCKET`` stay in the parent;
:func:`job_environ` hands the Hugging Face token to the download job alone.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import psutil

from jobs.events import JobEvent, Log

# The one decoder of job stdout: every line becomes a typed event.
_decoder = msgspec.json.Decoder(JobEvent)

# ------------------------------------------------------------------ child environment

CHILD_ENV_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM",
    "LD_LIBRARY_PATH",  # CUDA / ROCm libraries outside the default search path
    "XDG_CACHE_HOME",  # kernel and compile caches (engine, torch)
    "HF_HOME", "HF_ENDPOINT",
    # Downloads behind a proxy or a private CA (a proxy URL may hold its own login).
    "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
})
CHILD_ENV_PREFIXES = (
    "LC_",
    "CUDA_", "NVIDIA_", "HIP_", "ROCR_", "HSA_",  # device selection and driver knobs
    "GGML_", "LLAMA_",  # the llama.cpp engine's own settings
    "VLLM_",  # the vLLM engine's own settings (VLLM_CPU_OMP_THREADS_BIND, VLLM_ATTENTION_BACKEND, ...)
    "OMP_", "MKL_", "OPENBLAS_",  # threading
    "PYTHON",  # PYTHONPATH and the like: what it takes to run at all
    "PYTORCH_", "TORCH_",  # fine-tuning
    "HF_HUB_", "HF_DATASETS_",  # download and cache behaviour (HF_HUB_OFFLINE, HF_HUB_CACHE)
)
# Never inherited, whatever the prefix says.
# API_KEY: vLLM's own server reads VLLM_API_KEY, which no worker needs.
_SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "CREDENTIAL", "API_KEY")
HF_TOKEN = "HF_TOKEN"
# Kinds that talk to the Hugging Face Hub; only they get the token.
HF_TOKEN_KINDS = frozenset({"download"})


def _inherited(name: str) -> bool:
    if any(word in name.upper() for word in _SECRET_WORDS):
        return False
    return name in CHILD_ENV_NAMES or name.startswith(CHILD_ENV_PREFIXES)


def child_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """The part of ``environ`` a child process may see (see CHILD_ENV_*)."""
    return {k: v for k, v in environ.items() if _inherited(k)}


def job_settings(kind: str, environ: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    """What the parent sets over a job's allowlisted environment, wherever
    it runs: ``extra`` (the runner's settings) and, for a kind that
    downloads, the token (configured, or the parent's own HF_TOKEN)."""
    env = {k: v for k, v in extra.items() if k != HF_TOKEN}
    token = extra.get(HF_TOKEN) or environ.get(HF_TOKEN)
    if kind in HF_TOKEN_KINDS and token:
        env[HF_TOKEN] = token
    return env


def job_environ(kind: str, environ: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    """A job's environment on this machine: the allowlist and job_settings."""
    return {**child_environ(environ), **job_settings(kind, environ, extra)}


@dataclass
class Framed:
    events: list[JobEvent] = field(default_factory=list)
    keepalives: int = 0


class EventFramer:
    """Splits a byte stream into bounded NDJSON lines and decodes events."""

    def __init__(self, max_line_bytes: int = 1 << 20) -> None:
        self.max_line_bytes = max_line_bytes
        self._buf = bytearray()
        self._skipping = False

    def feed(self, chunk: bytes) -> Framed:
        out = Framed()
        self._buf += chunk
        start = 0
        while (end := self._buf.find(b"\n", start)) != -1:
            line = bytes(self._buf[start:end])
            start = end + 1
            if self._skipping:
                # The tail of an over-long line: dropped, already reported.
                self._skipping = False
                continue
            self._line(line, out)
        del self._buf[:start]
        if len(self._buf) > self.max_line_bytes:
            self._buf.clear()
            self._skipping = True
            out.events.append(_warning(f"event line over {self.max_line_bytes} bytes dropped"))
        return out

    def finish(self) -> Framed:
        """At EOF: a last line without its newline is still decoded."""
        out = Framed()
        if self._buf and not self._skipping:
            self._line(bytes(self._buf), out)
        self._buf.clear()
        return out

    def _line(self, line: bytes, out: Framed) -> None:
        if not line.strip():
            out.keepalives += 1
            return
        try:
            event = _decoder.decode(line)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            # RecursionError: msgspec's guard against deeply nested input.
            text = line[:300].decode(errors="replace")
            out.events.append(_warning(f"malformed event line ({exc}): {text}"))
            return
        out.events.append(event)


def _warning(message: str) -> Log:
    return Log({"message": message, "level": "warning"})


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to the group; False when the group no longer exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        # Only a foreign group would refuse us: treat it as not ours.
        return False
    return True


def group_alive(pgid: int) -> bool:
    """True while any non-zombie process is in the group."""
    if not signal_group(pgid, 0):
        return False
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            continue
    return False


async def wait_group_gone(pgid: int, timeout: float, interval: float = 0.05) -> bool:
    """Poll (no event exists for a group's end) until gone or timeout."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while group_alive(pgid):
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(interval)
    return True


async def kill_group(pgid: int, timeout: float = 10.0) -> bool:
    """SIGKILL the group and wait until it is gone."""
    if not group_alive(pgid):
        return True
    signal_group(pgid, signal.SIGKILL)
    return await wait_group_gone(pgid, timeout)


def log_tail(path: Path, max_bytes: int) -> str:
    """The last ``max_bytes`` of a log file, decoded leniently."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return ""
    text = data.decode(errors="replace")
    if size > max_bytes:
        text = text.split("\n", 1)[-1] if "\n" in text else text
    return text.strip()


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


# ------------------------------------------------------------------ boot recovery


def _same_process(proc: psutil.Process, create_time: float | None) -> bool:
    if create_time is None:
        return False
    try:
        return abs(float(proc.create_time()) - create_time) < 0.05
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def kill_leftover_group(pid: int, pgid: int | None, create_time: float | None) -> list[int]:
    """SIGKILL a recorded job's processes, only if they are provably ours.

    The leader is ours when pid and create_time match the record: then the
    whole group goes. A pid that exists with another create_time was reused:
    not ours, touch nothing. A leader that is gone may leave members behind;
    the kernel never hands out a pid whose group id is still in use, so the
    members still carrying the recorded group id are ours.
    """
    if pgid is None or create_time is None:
        return []
    try:
        leader = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return _kill_members(pgid, create_time)
    if not _same_process(leader, create_time):
        return []
    try:
        if os.getpgid(pid) == pgid:
            os.killpg(pgid, signal.SIGKILL)
            return [pid]
    except (ProcessLookupError, PermissionError):
        pass
    return []


def _kill_members(pgid: int, create_time: float) -> list[int]:
    killed = []
    for proc in psutil.process_iter(["pid", "create_time"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["create_time"] >= create_time - 0.05:
                proc.kill()
                killed.append(proc.pid)
        except (psutil.NoSuchProcess, ProcessLookupError, PermissionError, psutil.AccessDenied):
            continue
    return killed
