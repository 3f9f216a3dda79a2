"""The node agent: what runs on a cluster node to start the parent's workers there.

One ``NodeAgent`` runs per node as a Ray actor the parent creates, pinned
to that node and booking no CPU (supervisor/workers/ray_launcher.py). It is
the node's half of a ``Started``: it starts ``python -m worker`` with the
command line the parent built (launcher.worker_argv), in its own session
and process group, with the allowlisted environment of this node plus the
parent's pinned devices, its output appended to a log on this node; it
reads this node's free memory (its GPUs as the parent reads its own:
nvidia-smi, else amd-smi, rocm-smi or the amdgpu driver's sysfs; else its RAM)
for the parent's lease and placement, and the GGUF header of a model in
this node's own Hub cache, which the parent cannot read; it
holds the worker's stdin (the secret is the first line, and the agent's
end, when the parent's driver dies and Ray ends its actors, ends the
worker), and it signals, measures and reaps the worker on the parent's
word.

This module runs in a Ray worker process on the node: it imports only the
small process helpers the local launcher uses too (stdlib, psutil,
msgspec) and the GGUF header reader, never the parent's service modules, and it does not import Ray.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import psutil

from supervisor.lab.job_process import child_environ, kill_group, signal_group
from supervisor.models.amd_smi import SYSFS_DRM, AmdSource
from supervisor.models.devices import DeviceSource, SmiSource, SystemSource
from supervisor.models.gguf_header import GgufError
from supervisor.models.gguf_info import read_gguf_info
from supervisor.workers.crash import log_size, read_log_tail
from supervisor.workers.launcher import _open_log, _rss, kill_group_leftovers
from supervisor.workers.node_hub import (
    Removal,
    check_files,
    hub_cache_dir,
    remove_files,
)
from worker import protocol as p

# Workers one agent keeps track of at once; a parent asks for one per model
# spawn and reaps it, so more means a parent that forgets to clean up.
MAX_CHILDREN = 64


@dataclass
class _Child:
    proc: asyncio.subprocess.Process
    log_path: Path
    log_start: int
    engine_socket: Path


@dataclass
class _Job:
    proc: asyncio.subprocess.Process
    log_path: Path
    log_start: int


# The most of a job's stdout one read_job answer carries.
JOB_READ_BYTES = 1 << 16
# Jobs one agent runs at once (a parent runs one per device at most).
MAX_JOBS = 64


def node_gpu_source(drm: Path = SYSFS_DRM) -> SystemSource:
    """This node's GPUs, read by the code the parent reads its own with
    (devices.SystemSource): NVIDIA ones through nvidia-smi, else AMD ones
    through amd-smi, rocm-smi or amdgpu's sysfs under ``drm``. Every GPU of
    the node: Ray hides them from this actor (it books none) through the
    visible-devices variables, so neither reader heeds this process's."""
    return SystemSource([("nvidia-smi", SmiSource(environ={})), ("amd", AmdSource(drm=drm, environ={}))])


class UnknownWorker(LookupError):
    """A pid this agent did not start (or already cleaned up)."""


class NodeAgent:
    """Starts and tends the parent's worker processes on this node."""

    def __init__(self, state_dir: str = "", gpus: DeviceSource | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
        # Node-local files: the engine sockets and the worker logs. A short
        # path by default: Unix socket paths are limited to ~108 bytes.
        base = Path(state_dir) if state_dir else Path(tempfile.mkdtemp(prefix="gpuvisor-node-"))
        self.run_dir = base / "run"
        self.log_dir = base / "logs"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._children: dict[int, _Child] = {}
        self._jobs: dict[int, _Job] = {}
        # One source for the agent's life: the tool that first showed GPUs is
        # asked again (not a broken nvidia-smi each time on an AMD node), and
        # amd-smi's names are read once.
        self._gpus = node_gpu_source() if gpus is None else gpus
        # Where this node's Hub cache is read from: its own environment (a test gives another).
        self._environ = environ

    async def where(self) -> dict[str, str | int]:
        """This agent's process and its node-local directories."""
        return {"pid": os.getpid(), "run_dir": str(self.run_dir), "log_dir": str(self.log_dir),
                "host": os.uname().nodename}

    async def read_memory(self) -> dict[str, list[Any]]:
        """This node's GPUs (``index, uuid, name, free, total`` in bytes, as
        nvidia-smi, amd-smi or rocm-smi reports them: the index is the one
        ``CUDA_VISIBLE_DEVICES`` or ``ROCR_VISIBLE_DEVICES`` selects) and its
        RAM (free, total); no GPUs without a GPU driver. DeviceReadError when
        a tool is there and fails. Plain lists: the parent builds its own
        readings, and pins the GPUs it places on for each worker itself."""
        readings = await asyncio.to_thread(self._gpus.read)
        ram = psutil.virtual_memory()
        gpus: list[list[str | int]] = [[r.index, r.uuid, r.name, r.free_bytes, r.total_bytes] for r in readings]
        return {"gpus": gpus,
                "ram": [int(ram.available), int(ram.total)]}

    async def read_model(self, path: str) -> bytes:
        """The GGUF header of a model file on this node (GgufInfo, msgpack):
        a model in this node's own Hub cache is sized from it by the parent,
        which cannot read this disk. OSError when it is no readable GGUF."""
        try:
            info = await asyncio.to_thread(read_gguf_info, Path(path))
        except GgufError as exc:
            raise OSError(str(exc)) from exc
        return msgspec.msgpack.encode(info)

    def hub_cache(self) -> Path:
        """This node's own Hub cache: the one a download job run here fills
        (from the same allowlisted environment, read at each call)."""
        return hub_cache_dir(child_environ(os.environ if self._environ is None else self._environ))

    async def check_hub_files(self, paths: list[str]) -> dict[str, list[str]]:
        """Which of these files of this node's Hub cache are there
        (node_hub.check_files): a model recorded here may have lost its file."""
        return await asyncio.to_thread(check_files, self.hub_cache(), paths)

    async def remove_hub_files(self, paths: list[str]) -> Removal:
        """Remove these files of this node's Hub cache (node_hub.remove_files:
        nothing outside it, nothing at all when one path is refused)."""
        return await asyncio.to_thread(remove_files, self.hub_cache(), paths)

    async def start(self, argv: list[str], extra_env: dict[str, str], secret: bytes, log_name: str,
                    own_python: bool) -> int:
        """Start a worker; its pid. ``own_python``: run it with this node's
        interpreter (the parent's path may not exist here)."""
        if len(self._children) >= MAX_CHILDREN:
            raise RuntimeError(f"this node agent tends {MAX_CHILDREN} workers already")
        if Path(log_name).name != log_name or not log_name:
            raise ValueError(f"a log name, not a path: {log_name!r}")
        args = [sys.executable, *argv[1:]] if own_python else list(argv)
        env = child_environ(os.environ)  # an allowlist: no token of this node reaches a worker
        env.update(extra_env)
        log_path = self.log_dir / log_name
        log_start = log_size(log_path)
        with _open_log(log_path) as logfile:
            proc = await asyncio.create_subprocess_exec(
                *args, stdin=asyncio.subprocess.PIPE, stdout=logfile, stderr=logfile,
                start_new_session=True, env=env)
        assert proc.stdin is not None
        proc.stdin.write(p.secret_line(secret))
        self._children[proc.pid] = _Child(proc, log_path, log_start, _engine_socket(argv))
        return proc.pid

    async def wait(self, pid: int) -> int:
        """The worker's exit status, once it exits."""
        return await self._child(pid).proc.wait()

    async def status(self, pid: int) -> tuple[int | None, int]:
        """The worker's exit status (None while it runs) and resident bytes."""
        child = self._child(pid)
        return child.proc.returncode, _rss(pid) if child.proc.returncode is None else 0

    async def kill(self, pid: int, sig: int) -> None:
        child = self._child(pid)
        if child.proc.returncode is None:
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                pass  # already gone: nothing to kill

    async def log_tail(self, pid: int) -> str:
        child = self._child(pid)
        return read_log_tail(child.log_path, child.log_start)

    async def cleanup(self, pid: int) -> None:
        """After its exit: end what is left of its group and forget it."""
        child = self._children.pop(pid, None)
        if child is None:
            return
        kill_group_leftovers(pid)
        child.engine_socket.unlink(missing_ok=True)

    # ------------------------------------------------------------ jobs

    async def start_job(self, argv: list[str], extra_env: dict[str, str], stdin_line: bytes,
                        log_name: str) -> int:
        """Start ``python <argv>`` (``-m jobs <kind>``) with this node's
        interpreter in its own session; its pid (its group's id). The params
        line goes on its stdin, which stays open."""
        if len(self._jobs) >= MAX_JOBS:
            raise RuntimeError(f"this node agent runs {MAX_JOBS} jobs already")
        if Path(log_name).name != log_name or not log_name:
            raise ValueError(f"a log name, not a path: {log_name!r}")
        env = child_environ(os.environ)  # an allowlist: no token of this node reaches a job
        env.update(extra_env)
        log_path = self.log_dir / log_name
        log_start = log_size(log_path)
        with _open_log(log_path) as logfile:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=logfile, start_new_session=True, env=env)
        assert proc.stdin is not None
        self._jobs[proc.pid] = _Job(proc, log_path, log_start)
        try:
            proc.stdin.write(stdin_line)
            await proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass  # it exited at once: its exit status tells why
        return proc.pid

    async def read_job(self, pid: int, wait_s: float) -> tuple[bytes, int | None]:
        """What the job wrote on stdout since the last read, waiting up to
        ``wait_s`` for some; at its end ``b""`` and its exit status."""
        job = self._job(pid)
        assert job.proc.stdout is not None
        try:
            # A read cancelled by the timeout consumes nothing.
            data = await asyncio.wait_for(job.proc.stdout.read(JOB_READ_BYTES), wait_s)
        except TimeoutError:
            return b"", None
        if data:
            return data, None
        return b"", await job.proc.wait()

    async def signal_job(self, pid: int, sig: int) -> bool:
        """Signal the job's whole group; False when the group is gone."""
        self._job(pid)
        return signal_group(pid, sig)

    async def read_job_log(self, pid: int, offset: int, max_bytes: int) -> bytes:
        """Up to ``max_bytes`` (at most JOB_READ_BYTES) of the job's log from
        ``offset`` (counted from where this job's lines start): the parent
        streams it while the job runs."""
        job = self._job(pid)
        return await asyncio.to_thread(_read_span, job.log_path, job.log_start + offset,
                                       min(max_bytes, JOB_READ_BYTES))

    async def job_log_tail(self, pid: int) -> str:
        job = self._job(pid)
        return read_log_tail(job.log_path, job.log_start)

    async def cleanup_job(self, pid: int) -> None:
        """After its end: kill what is left of its group, close its stdin, forget it."""
        job = self._jobs.pop(pid, None)
        if job is None:
            return
        await kill_group(pid)
        if job.proc.returncode is None:
            await job.proc.wait()
        if job.proc.stdin is not None:
            job.proc.stdin.close()

    def _job(self, pid: int) -> _Job:
        try:
            return self._jobs[pid]
        except KeyError:
            raise UnknownWorker(f"no job with pid {pid} on this node") from None

    def _child(self, pid: int) -> _Child:
        try:
            return self._children[pid]
        except KeyError:
            raise UnknownWorker(f"no worker with pid {pid} on this node") from None


def _read_span(path: Path, start: int, size: int) -> bytes:
    try:
        with path.open("rb") as f:
            f.seek(start)
            return f.read(size)
    except FileNotFoundError:
        return b""  # not written yet


def _engine_socket(argv: list[str]) -> Path:
    """The engine's socket named on the worker's command line, which a
    killed engine leaves behind."""
    try:
        return Path(argv[argv.index("--engine-socket") + 1])
    except (ValueError, IndexError):
        raise ValueError("the worker's command line names no --engine-socket") from None
