"""One model-worker OS process: spawn, handshake, signal, reap.

``WorkerProcess`` starts ``python -m worker`` in its own process group with
its output appended to the model's log, accepts its IPC connection, waits for
its hello while reporting load progress, and later kills and reaps it (and
anything left in its group). It decides nothing: restarts, liveness and
request routing belong to the handle (supervisor/workers/handle.py).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import msgspec
import psutil

from supervisor.lab.job_process import child_environ
from supervisor.models.devices import pinned_environ
from supervisor.workers.crash import log_size, read_log_tail, worker_log_path
from supervisor.workers.spec import Timing, WorkerSpec
from worker import protocol as p

MAX_SOCKET_PATH = 100
WORKER_LOG_MAX_BYTES = 32 << 20


class HandshakeFailed(Exception):
    pass


class LoadFailed(Exception):
    pass


class WorkerProcess:
    """The current worker process of one handle (one at a time, many over restarts)."""

    def __init__(self, spec: WorkerSpec, timing: Timing, run_dir: Path, log_dir: Path,
                 clock: Callable[[], float], tag: int) -> None:
        self.spec = spec
        self.timing = timing
        self.run_dir = run_dir
        self.log_dir = log_dir
        self.clock = clock
        self.tag = tag  # tells this handle's sockets from another's in run_dir
        self.pid: int | None = None
        self.facts: p.ModelFacts | None = None
        self.load_progress: float | None = None
        self.codec = p.parent_codec()
        self._proc: asyncio.subprocess.Process | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._sock: Path | None = None
        # Where this process's output began in the log, and the signals we sent
        # it (a signal we sent is not the worker's own crash).
        self._log_start = 0
        self.sent_signals: set[int] = set()

    @property
    def log_path(self) -> Path:
        return worker_log_path(self.log_dir, self.spec.model_id, self.spec.embedding)

    def log_tail(self) -> str:
        """The current process's last lines in the log."""
        return read_log_tail(self.log_path, self._log_start)

    # ------------------------------------------------------------ writing

    def encode(self, msg: msgspec.Struct) -> bytes:
        return self.codec.encode(msg)

    def write(self, frame: bytes) -> None:
        """Write a frame if connected; a frame to a dead worker is dropped (its crash says why)."""
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(frame)

    def send(self, msg: msgspec.Struct) -> None:
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(self.codec.encode(msg))

    # ------------------------------------------------------------ start

    def _socket_path(self, generation: int) -> Path:
        path = self.run_dir / f"w{os.getpid()}-{self.tag % 100000}-{generation}.sock"
        if len(str(path)) > MAX_SOCKET_PATH:
            raise OSError(f"socket path {path} is longer than {MAX_SOCKET_PATH} bytes; use a shorter state dir")
        return path

    async def spawn(self, generation: int) -> asyncio.StreamReader:
        """Start a process and finish its handshake; the reader carries its messages."""
        self._log_start = log_size(self.log_path)  # a crash shows only this process's lines
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        sock = self._sock = self._socket_path(generation)
        sock.unlink(missing_ok=True)
        connected: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = (
            asyncio.get_running_loop().create_future())

        def on_connect(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            if connected.done():
                w.close()
            else:
                connected.set_result((r, w))

        server = await asyncio.start_unix_server(on_connect, path=str(sock))
        try:
            self._proc = await self._exec(sock)
            self.pid = self._proc.pid
            await self._wait_loading(self._proc, connected)
            reader, writer = connected.result()
        finally:
            server.close()
            sock.unlink(missing_ok=True)
        self._writer = writer
        await self._handshake(reader)
        return reader

    async def _wait_loading(self, proc: asyncio.subprocess.Process,
                            connected: asyncio.Future[Any]) -> None:
        """Wait for ``connected`` (a connection, then the hello), reporting load progress.

        Progress is the worker's resident memory against the size of the
        model's files (every shard: :func:`load_size`); the load fails when
        that stops growing for ``load_stall_timeout`` (a big model may take
        minutes, a stuck one should not), or when the whole handshake takes
        longer than ``handshake_timeout``.
        """
        size = load_size(self.spec)
        exited = asyncio.ensure_future(proc.wait())
        start = last_growth = self.clock()
        last_rss = 0
        self.load_progress = 0.0
        try:
            while not connected.done():
                done, _ = await asyncio.wait({connected, exited}, timeout=0.25,
                                             return_when=asyncio.FIRST_COMPLETED)
                if exited in done and not connected.done():
                    raise HandshakeFailed("worker exited during its handshake")
                rss = _rss(proc.pid)
                now = self.clock()
                if rss > last_rss:
                    last_rss, last_growth = rss, now
                    self.load_progress = min(0.99, rss / size)
                if now - last_growth > self.timing.load_stall_timeout:
                    raise HandshakeFailed(
                        f"loading stalled: no progress for {self.timing.load_stall_timeout:.0f}s")
                if now - start > self.timing.handshake_timeout:
                    raise HandshakeFailed("no hello within the handshake timeout")
        finally:
            exited.cancel()
            if not connected.done():
                connected.cancel()

    def _args(self, sock: Path) -> list[str]:
        s = self.spec
        args = [s.python or sys.executable, "-m", "worker", "--engine", s.engine,
                "--socket", str(sock), "--model", str(s.path),
                "--n-ctx", str(s.n_ctx), "--n-gpu-layers", str(s.n_gpu_layers),
                "--threads", str(s.n_threads), "--heartbeat", str(self.timing.heartbeat),
                "--parallel", str(max(1, s.parallel)), "--engine-socket", str(_engine_socket(sock))]
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

    async def _exec(self, sock: Path) -> asyncio.subprocess.Process:
        env = child_environ(os.environ)  # an allowlist: no token reaches a worker
        env.update(worker_environ(self.spec))
        # The child keeps its own descriptor: ours closes once it is spawned.
        with _open_log(self.log_path) as logfile:
            return await asyncio.create_subprocess_exec(
                *self._args(sock), stdin=asyncio.subprocess.PIPE, stdout=logfile, stderr=logfile,
                start_new_session=True, env=env)

    async def _handshake(self, reader: asyncio.StreamReader) -> None:
        assert self._proc is not None
        hello = asyncio.ensure_future(p.read_frame(reader))
        try:
            await self._wait_loading(self._proc, hello)
        finally:
            self.load_progress = None
        body = hello.result()
        if body is None:
            raise HandshakeFailed("worker closed the connection before its hello")
        msg = self.codec.decode(body)
        if isinstance(msg, p.LoadFailed):
            raise LoadFailed(msg.reason)
        if not isinstance(msg, p.Hello):
            raise HandshakeFailed(f"expected hello, got {type(msg).__name__}")
        if msg.protocol_version != p.PROTOCOL_VERSION:
            raise LoadFailed(f"worker speaks protocol {msg.protocol_version}, parent {p.PROTOCOL_VERSION}")
        self.facts = msg.facts

    # ------------------------------------------------------------ end

    def kill(self, sig: int) -> None:
        """Signal the process's group, if the process still runs."""
        if self._proc is not None and self._proc.returncode is None:
            self.sent_signals.add(sig)
            try:
                os.killpg(self._proc.pid, sig)
            except ProcessLookupError:
                pass  # already gone: nothing to kill

    async def wait(self) -> None:
        if self._proc is not None:
            await self._proc.wait()

    async def reap(self, shutdown: bool) -> int | None:
        """Close the connection (saying Shutdown first if ``shutdown``) and wait for the process."""
        proc = self._proc
        if self._writer is not None:
            if shutdown and not self._writer.is_closing():
                self._writer.write(self.codec.encode(p.Shutdown()))
            self._writer.close()
            self._writer = None
        if proc is None:
            return None
        try:
            await asyncio.wait_for(proc.wait(), self.timing.kill_grace)
        except TimeoutError:
            self.kill(signal.SIGKILL)
            await proc.wait()
        # The group may hold helpers of the worker; none may outlive it.
        kill_group_leftovers(proc.pid)
        # A killed engine leaves its listener's socket file behind.
        if self._sock is not None:
            _engine_socket(self._sock).unlink(missing_ok=True)
        self._proc = None
        return proc.returncode


def load_size(spec: WorkerSpec) -> int:
    """The bytes a worker loads: all of the model's files as the library
    counted them, else (a spec made without it) the size of its path."""
    if spec.model_bytes > 0:
        return spec.model_bytes
    try:
        return max(1, spec.path.stat().st_size)
    except OSError:
        return 1  # gone or unreadable: the worker's load fails and says why


def worker_environ(spec: WorkerSpec) -> dict[str, str]:
    """What a worker's environment gets on top of the allowlist: exactly its
    GPUs, so the engine cannot spread over GPUs the lease did not book."""
    return {} if spec.gpu_indices is None else pinned_environ(spec.gpu_indices)


def kill_group_leftovers(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is empty: the normal case


def _engine_socket(ipc_socket: Path) -> Path:
    """The worker engine's own listener, beside our IPC socket (same length + 2)."""
    return ipc_socket.with_name(ipc_socket.stem + ".e.sock")


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
