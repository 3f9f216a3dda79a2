"""One run of Python code in the sandbox, from the parent's side.

The child is ``init.py`` (see its docstring for what it sets up), started
fresh per run in its own session, the code on its stdin. The parent bounds
what comes back (each log stream to ``log_bytes``, the rest read and
dropped so the child never blocks on a full pipe) and the time: at the wall
clock the whole group is killed, and with it (the parent-death signal of PID
1 of the sandbox's PID namespace) every process the code started, even one
that left the group.

:func:`probe` runs a trivial program the same way: a service enables the
tool only when it works, else it names the reason (no namespace can be made,
the Python cannot run as the sandbox's user, ...).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from supervisor.lab.job_process import child_environ
from supervisor.sandbox import init

INIT_SCRIPT = Path(init.__file__).resolve()
MAX_CODE_BYTES = 1 << 20
# What the code sees of the service's environment, after the job allowlist
# (which already drops every name holding a secret word): the locale and the
# time zone. Proxies, caches and the engine's knobs are no business of it.
SANDBOX_ENV_NAMES = frozenset({"LANG", "LANGUAGE", "TZ"})
SANDBOX_ENV_PREFIXES = ("LC_",)
_PATH = "/usr/local/bin:/usr/bin:/bin"
_READ_CHUNK = 1 << 16


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 30
    memory_mib: int = 1024
    wall_s: float = 60.0
    file_mib: int = 64
    processes: int = 32
    open_files: int = 256
    log_bytes: int = 64 * 1024
    tmp_mib: int = 64

    def rlimits(self) -> dict[str, int]:
        return {
            "RLIMIT_CPU": self.cpu_s,
            "RLIMIT_AS": self.memory_mib << 20,
            "RLIMIT_FSIZE": self.file_mib << 20,
            "RLIMIT_NPROC": self.processes,
            "RLIMIT_NOFILE": self.open_files,
            "RLIMIT_CORE": 0,
        }


@dataclass(frozen=True)
class SandboxSpec:
    """Where and as whom the code runs: the Python, the paths hidden from it
    (the state dir, the models), the uid/gid a root service drops to."""

    python: str = sys.executable
    hide: tuple[str, ...] = ()
    uid: int = 65534
    gid: int = 65534
    limits: SandboxLimits = SandboxLimits()


@dataclass(frozen=True)
class RunResult:
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    # None when killed at the wall clock; 128 + N for a signal N.
    exit_code: int | None
    timed_out: bool
    # The sandbox could not be set up (the code never ran): why.
    setup_error: str | None
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


def sandbox_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """The code's environment: the locale of the service, never a secret."""
    env = {k: v for k, v in child_environ(environ).items()
           if k in SANDBOX_ENV_NAMES or k.startswith(SANDBOX_ENV_PREFIXES)}
    env.update({
        "PATH": _PATH, "HOME": init.WORK, "TMPDIR": "/tmp", "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONIOENCODING": "utf-8", "MPLBACKEND": "Agg",
        # Threads count against the process limit: one per library pool.
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
    })
    return env


def init_spec(spec: SandboxSpec, work: Path, environ: Mapping[str, str]) -> str:
    return json.dumps({
        "work": str(work), "hide": list(spec.hide), "python": spec.python,
        "uid": spec.uid, "gid": spec.gid, "tmp_kib": spec.limits.tmp_mib * 1024,
        "rlimits": spec.limits.rlimits(), "env": sandbox_environ(environ),
        "wall_s": spec.limits.wall_s, "parent": os.getpid(),
    })


class _Capped:
    """Reads a stream to its end, keeping the first ``limit`` bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()
        self.truncated = False

    async def drain(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(_READ_CHUNK):
            room = self.limit - len(self.data)
            if len(chunk) > room:
                self.truncated = True
            self.data += chunk[:max(room, 0)]

    def text(self) -> str:
        return self.data.decode(errors="replace")


async def _feed(stdin: asyncio.StreamWriter, code: bytes) -> None:
    try:
        stdin.write(code)
        await stdin.drain()
        stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        # The child ended (or failed its setup) before reading it all: its
        # exit status and stderr say why.
        return


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        # Already gone: nothing left to signal.
        return


async def _end(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM asks the sandbox's first process to kill its whole PID
    namespace (a process that left the group too); then SIGKILL for the
    group, whatever happened."""
    if proc.returncode is None:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(proc.wait()), 3.0)
        except TimeoutError:
            pass  # killed below all the same
    _signal_group(proc.pid, signal.SIGKILL)


async def run_code(spec: SandboxSpec, work: Path, code: str,
                   environ: Mapping[str, str] | None = None) -> RunResult:
    """Run ``code`` with ``work`` as its writable folder; never raises for
    what the code does (a crash, a limit, the wall clock)."""
    data = code.encode()
    if len(data) > MAX_CODE_BYTES:
        raise ValueError(f"code is {len(data)} bytes, over the limit of {MAX_CODE_BYTES}")
    loop = asyncio.get_running_loop()
    started = loop.time()
    argv = [sys.executable, "-I", "-S", str(INIT_SCRIPT),
            init_spec(spec, work, os.environ if environ is None else environ)]
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, start_new_session=True, env={"PATH": _PATH}, cwd="/")
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    out, err = _Capped(spec.limits.log_bytes), _Capped(spec.limits.log_bytes)
    io = asyncio.gather(_feed(proc.stdin, data), out.drain(proc.stdout), err.drain(proc.stderr))
    timed_out = False
    try:
        await asyncio.wait_for(asyncio.shield(io), spec.limits.wall_s)
    except TimeoutError:
        timed_out = True
    finally:
        # Also on cancellation (the client went away): nothing outlives the call.
        await _end(proc)
        if not io.done():
            # The pipes close once the group is dead; then the readers end.
            await asyncio.wait_for(io, 10.0)
        await proc.wait()
    exit_code = None if timed_out else proc.returncode
    if exit_code is not None and exit_code < 0:
        exit_code = 128 - exit_code
    stderr = err.text()
    setup_error = None
    if exit_code == init.SETUP_FAILED and stderr.startswith("sandbox: "):
        setup_error = stderr.splitlines()[0].removeprefix("sandbox: ")
    return RunResult(stdout=out.text(), stderr=stderr, stdout_truncated=out.truncated,
                     stderr_truncated=err.truncated, exit_code=exit_code, timed_out=timed_out,
                     setup_error=setup_error, wall_s=loop.time() - started)


async def probe(spec: SandboxSpec, work: Path) -> str | None:
    """None when code runs in the sandbox and has no network; else the
    reason the tool cannot be enabled. ``work``: an empty folder the
    sandbox's user may write."""
    check = ("import socket\n"
             "try:\n    socket.create_connection(('127.0.0.1', 9), timeout=2)\n"
             "except OSError as exc:\n    print('no network' if exc.errno == 101 else exc)\n")
    try:
        result = await run_code(spec, work, check)
    except OSError as exc:
        return f"the sandbox cannot start: {exc}"
    if result.setup_error is not None:
        return f"the sandbox cannot be set up: {result.setup_error}"
    if result.exit_code != 0:
        tail = result.stderr.strip().splitlines()[-1:] or [f"exit status {result.exit_code}"]
        return f"Python does not run in the sandbox ({spec.python}): {tail[0]}"
    if result.stdout.strip() != "no network":
        return f"the sandbox has a network: {result.stdout.strip()[:200]}"
    return None
