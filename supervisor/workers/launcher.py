"""Where a worker process runs: the ``Launcher`` seam and the local launcher.

A launcher starts ``python -m worker`` for a spec, told the address of the
parent's listener (supervisor/workers/connection.py) and the spawn's secret,
and returns a ``Started``: the one handle on that process the parent needs
(its pid, its exit, signals to its group, its memory while it loads, the
tail of its log). It decides nothing and connects nothing; the handle's
policy (supervisor/workers/handle.py) stays the same wherever it runs.

``LocalLauncher`` runs the worker on this machine: its own session and
process group, the allowlisted environment plus exactly its GPUs, its
output appended to the model's log, and its stdin held by the parent: the
secret is its first line, and its end (the parent gone) ends the worker.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import BinaryIO, Protocol

import psutil

from supervisor.lab.job_process import child_environ
from supervisor.models.devices import pinned_environ
from supervisor.workers.crash import log_size, read_log_tail, worker_log_path
from supervisor.workers.spec import Timing, WorkerSpec
from worker import protocol as p

MAX_SOCKET_PATH = 100
WORKER_LOG_MAX_BYTES = 32 << 20


class Started(Protocol):
    """One started worker process, wherever it runs."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def kill(self, sig: int) -> None:
        """Signal the process's group, if the process still runs."""

    def rss(self) -> int:
        """Resident bytes of the process and its children (0 once gone)."""

    def log_tail(self) -> str:
        """This process's last lines in the model's log."""

    def cleanup(self) -> None:
        """After its exit: end what is left of its group, remove its files."""

    @property
    def host_lost(self) -> bool:
        """Whether it ended with what tended it on its machine (a cluster
        node's agent, gone with its node): never for a local process."""
        ...


class Launcher(Protocol):
    def log_path(self, spec: WorkerSpec) -> Path:
        """Where the parent reads the model's worker log."""

    async def start(self, spec: WorkerSpec, timing: Timing, address: list[str], secret: bytes,
                    stem: str) -> Started:
        """Start a worker for ``spec`` that dials ``address`` (its arguments)
        and proves ``secret``; ``stem`` names this spawn's files."""


class LocalLauncher:
    def __init__(self, run_dir: Path, log_dir: Path) -> None:
        self.run_dir = run_dir
        self.log_dir = log_dir

    def log_path(self, spec: WorkerSpec) -> Path:
        return worker_log_path(self.log_dir, spec.model_id, spec.embedding)

    async def start(self, spec: WorkerSpec, timing: Timing, address: list[str], secret: bytes,
                    stem: str) -> LocalProcess:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        engine_socket = socket_path(self.run_dir, stem + ".e")
        log_path = self.log_path(spec)
        log_start = log_size(log_path)  # a crash shows only this process's lines
        env = child_environ(os.environ)  # an allowlist: no token reaches a worker
        env.update(worker_environ(spec))
        # The child keeps its own descriptor: ours closes once it is spawned.
        with _open_log(log_path) as logfile:
            proc = await asyncio.create_subprocess_exec(
                *worker_argv(spec, timing, address, engine_socket), stdin=asyncio.subprocess.PIPE,
                stdout=logfile, stderr=logfile, start_new_session=True, env=env)
        assert proc.stdin is not None
        # The secret goes by stdin: the command line is readable by every user.
        proc.stdin.write(p.secret_line(secret))
        return LocalProcess(proc, log_path, log_start, engine_socket)


class LocalProcess:
    """A worker process on this machine, in its own process group."""

    def __init__(self, proc: asyncio.subprocess.Process, log_path: Path, log_start: int,
                 engine_socket: Path) -> None:
        self._proc = proc
        self._log_path = log_path
        self._log_start = log_start
        self._engine_socket = engine_socket

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    async def wait(self) -> int:
        return await self._proc.wait()

    def kill(self, sig: int) -> None:
        if self._proc.returncode is None:
            try:
                os.killpg(self._proc.pid, sig)
            except ProcessLookupError:
                pass  # already gone: nothing to kill

    def rss(self) -> int:
        return _rss(self._proc.pid)

    @property
    def host_lost(self) -> bool:
        return False  # this machine: the parent's own

    def log_tail(self) -> str:
        return read_log_tail(self._log_path, self._log_start)

    def cleanup(self) -> None:
        # The group may hold helpers of the worker; none may outlive it.
        kill_group_leftovers(self._proc.pid)
        # A killed engine leaves its listener's socket file behind.
        self._engine_socket.unlink(missing_ok=True)


def socket_path(run_dir: Path, stem: str) -> Path:
    path = run_dir / f"{stem}.sock"
    if len(str(path)) > MAX_SOCKET_PATH:
        raise OSError(f"socket path {path} is longer than {MAX_SOCKET_PATH} bytes; use a shorter state dir")
    return path


def worker_argv(spec: WorkerSpec, timing: Timing, address: list[str], engine_socket: Path) -> list[str]:
    """The worker's command line (no secret: that goes by stdin)."""
    s = spec
    args = [s.python or sys.executable, "-m", "worker", "--engine", s.engine, *address,
            "--model", str(s.path),
            "--n-ctx", str(s.n_ctx), "--n-gpu-layers", str(s.n_gpu_layers),
            "--threads", str(s.n_threads), "--heartbeat", str(timing.heartbeat),
            "--parallel", str(max(1, s.parallel)), "--engine-socket", str(engine_socket)]
    if s.embedding:
        args.append("--embedding")
    if s.cache_type != "f16":
        args += ["--cache-type", s.cache_type]
    args += s.speculative.argv()
    args += s.rope.argv()
    if s.tensor_split:
        args += ["--tensor-split", ",".join(f"{x:.4f}" for x in s.tensor_split)]
    if s.mmproj is not None:
        args += ["--mmproj", str(s.mmproj)]
    for adapter in s.lora:
        args += ["--lora", str(adapter)]
    if s.chat_template_file is not None:
        args += ["--chat-template-file", str(s.chat_template_file)]
    return args


def worker_environ(spec: WorkerSpec) -> dict[str, str]:
    """What a worker's environment gets on top of the allowlist: exactly its
    GPUs, so the engine cannot spread over GPUs the lease did not book."""
    return {} if spec.gpu_indices is None else pinned_environ(spec.gpu_indices)


def kill_group_leftovers(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is empty: the normal case


def _rss(pid: int) -> int:
    """Resident memory of the worker and its children: a vLLM worker loads
    the model in its engine-core process, while its own memory stays flat."""
    try:
        proc = psutil.Process(pid)
        total = int(proc.memory_info().rss)
        children = proc.children(recursive=True)
    except psutil.Error:
        return 0  # exited or not visible: the caller sees the exit itself
    for child in children:
        try:
            total += int(child.memory_info().rss)
        except psutil.Error:
            continue  # a child that just exited: counted as nothing
    return total


def _open_log(path: Path) -> BinaryIO:
    """The worker's log, for appending, rotated first if it grew too big."""
    _rotate(path)
    return open(path, "ab")


def _rotate(path: Path) -> None:
    """Keep one previous worker log once it grows past WORKER_LOG_MAX_BYTES
    (a line per request adds up over months of service)."""
    try:
        if path.stat().st_size > WORKER_LOG_MAX_BYTES:
            path.replace(path.with_name(path.name + ".1"))
    except FileNotFoundError:
        pass  # the first start of this model: nothing to rotate
