"""One model worker process as the parent sees it.

A ``WorkerHandle`` owns the worker's process, its IPC connection, a FIFO queue
of requests and a supervising task that spawns, watches (ping/pong), and
restarts the worker with backoff. State lives in one enum, not in flags.
Up to ``spec.parallel`` requests are in flight at once (the worker's engine
slots); the rest wait in the queue. Requests queued but not yet sent survive
a crash and go to the restarted worker; those in flight end with a
``WorkerGone`` event.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import os
import signal
import sys
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import msgspec
import psutil

from supervisor.lab.job_process import child_environ
from worker import protocol as p

log = logging.getLogger("gpuvisor.worker")

EXIT_LOAD_FAILED = p.EXIT_LOAD_FAILED
MAX_SOCKET_PATH = 100
WORKER_LOG_MAX_BYTES = 32 << 20


class WorkerState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPING = "stopping"
    STOPPED = "stopped"
    CRASHED = "crashed"
    FAILED = "failed"


class Cause(enum.StrEnum):
    """Why a worker process ended without being asked to; restarts count by it."""

    EXITED = "exited"  # it exited or was killed by a signal on its own
    HUNG = "hung"  # no answer to ping: aborted
    IPC_BROKEN = "ipc_broken"  # its socket stream broke or went out of sync
    HANDSHAKE_FAILED = "handshake_failed"  # died, stalled or timed out before ready


class WorkerGone(msgspec.Struct):
    """Terminal event for a request whose worker went away mid-request."""

    code: str  # worker_crashed | evicted | worker_stopped | model_failed
    message: str


class QueueFull(Exception):
    pass


class NotAccepting(Exception):
    """The handle takes no new requests (draining, stopping or failed)."""

    def __init__(self, state: WorkerState, reason: str) -> None:
        super().__init__(reason)
        self.state = state
        self.reason = reason


@dataclass(frozen=True)
class WorkerSpec:
    model_id: str
    path: Path
    embedding: bool
    n_ctx: int
    n_gpu_layers: int
    n_threads: int
    device: str = "cpu"
    cache_type: str = "f16"
    draft_ngram: int = 0
    # Requests the worker runs at once (its engine slots).
    parallel: int = 1
    # The vision projector (mmproj) to load with the model, if the library links one.
    mmproj: Path | None = None

    def same_settings(self, other: WorkerSpec) -> bool:
        return self._settings() == other._settings()

    def _settings(self) -> tuple[object, ...]:
        return (self.path, self.n_ctx, self.n_gpu_layers, self.cache_type, self.draft_ngram, self.parallel,
                self.mmproj)


@dataclass(frozen=True)
class Timing:
    handshake_timeout: float
    ping_interval: float
    ping_timeout: float
    kill_grace: float
    backoff_min: float
    backoff_max: float
    crash_limit: int
    crash_window: float
    heartbeat: float = 1.0
    # A load that shows no progress (worker memory not growing) for this long fails.
    load_stall_timeout: float = 60.0


@dataclass(eq=False)
class Pending:
    id: int
    msg: p.Generate | p.Embed | p.Tokenize
    events: asyncio.Queue[p.FromWorker | WorkerGone] = field(default_factory=asyncio.Queue)
    sent: bool = False
    finished: bool = False


class HandshakeFailed(Exception):
    pass


class LoadFailed(Exception):
    pass


class WorkerHandle:
    def __init__(self, spec: WorkerSpec, timing: Timing, run_dir: Path, log_dir: Path,
                 queue_limit: int, clock: Callable[[], float] | None = None) -> None:
        self.spec = spec
        self.timing = timing
        self.run_dir = run_dir
        self.log_dir = log_dir
        self.queue_limit = queue_limit
        self.clock = clock or asyncio.get_running_loop().time
        self.state = WorkerState.STARTING
        self.reason: str | None = None
        self.facts: p.ModelFacts | None = None
        self.pid: int | None = None
        self.restarts = 0
        self.restarts_by_cause: dict[Cause, int] = dict.fromkeys(Cause, 0)
        self.cause: Cause | None = None
        self.last_used = self.clock()
        self.last_seen = self.clock()
        self.load_progress: float | None = None
        # Seconds to stay loaded after the last request; negative = forever.
        self.keep_alive = 300.0
        self.stats: p.WorkerStats | None = None
        self.queue: deque[Pending] = deque()
        self.inflight: dict[int, Pending] = {}
        self.crash_times: deque[float] = deque()
        # Whether a crash counts toward crash_limit, given the requests in flight
        # (the pool's poison-request rule, supervisor/workers/poison.py).
        self.crash_counts: Callable[[list[Pending]], bool] = lambda _in_flight: True
        self.ready = asyncio.Event()
        self.changed = asyncio.Event()
        self._ids = itertools.count(1)
        self._proc: asyncio.subprocess.Process | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._codec = p.parent_codec()
        self._stop_requested = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # Crash diagnostics: the log's last lines at the last crash or failure,
        # where the current process's output began, and the signals we sent it
        # (a signal we sent is not the worker's own crash).
        self.log_tail: str | None = None
        self._log_start = 0
        self._sent_signals: set[int] = set()

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name=f"worker:{self.spec.model_id}")

    @property
    def busy(self) -> bool:
        return bool(self.inflight) or bool(self.queue)

    @property
    def accepting(self) -> bool:
        return self.state in (WorkerState.STARTING, WorkerState.READY, WorkerState.CRASHED)

    async def stop(self, reason: str = "stopped", code: str = "worker_stopped") -> None:
        """Stop the worker now; every pending request ends with ``code``."""
        if self.state not in (WorkerState.FAILED, WorkerState.STOPPED):
            self._set_state(WorkerState.STOPPING)
        self._stop_requested.set()
        self._fail_all(code, reason)
        self._send(p.Shutdown())
        task = self._task
        if task is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(task), self.timing.kill_grace * 2)
        except TimeoutError:
            # Stuck before the handshake or in a hung worker: kill the group.
            await self._kill(signal.SIGKILL)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            if self._proc is not None:
                await self._proc.wait()
        self._set_state(WorkerState.STOPPED)

    async def drain(self, timeout: float, reason: str, code: str = "evicted") -> None:
        """Take no new requests; let queued/in-flight ones finish up to timeout; stop."""
        if self.state in (WorkerState.READY, WorkerState.STARTING, WorkerState.CRASHED):
            self._set_state(WorkerState.DRAINING)
        deadline = self.clock() + timeout
        while self.busy and self.clock() < deadline:
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), max(0.0, deadline - self.clock()))
            except TimeoutError:
                break
        await self.stop(reason, code)

    def _set_state(self, state: WorkerState) -> None:
        self.state = state
        if state is WorkerState.READY:
            self.ready.set()
        else:
            self.ready.clear()
        self.changed.set()

    async def _supervise(self) -> None:
        while not self._stop_requested.is_set():
            self._set_state(WorkerState.STARTING)
            code = await self._run_once()
            if self._stop_requested.is_set():
                break
            if code == EXIT_LOAD_FAILED or self.state is WorkerState.FAILED:
                self._fail_permanently(load_failure_reason(self.reason))
                return
            if self._record_crash(code):
                return
            if await self._backoff():
                break
        self._set_state(WorkerState.STOPPED)

    def _record_crash(self, code: int | None) -> bool:
        """Count a crash; True when it was one too many (state FAILED)."""
        now = self.clock()
        if self.crash_counts(list(self.inflight.values())):
            self.crash_times.append(now)
        while self.crash_times and now - self.crash_times[0] > self.timing.crash_window:
            self.crash_times.popleft()
        signalled_by_us = code is not None and -code in self._sent_signals
        self._sent_signals.clear()
        self.reason = exit_reason(code, self._phase(), self.reason, signalled_by_us)
        self.cause = self.cause or Cause.EXITED
        self.log_tail = read_log_tail(self.log_path, self._log_start)
        log.warning("worker %s: %s (its log: %s)", self.spec.model_id, self.reason, self.log_path)
        self._set_state(WorkerState.CRASHED)
        for pend in list(self.inflight.values()):
            self._end(pend, WorkerGone("worker_crashed", self.reason if self.reason.startswith("the model worker")
                                       else f"the model worker crashed ({self.reason})"))
        if len(self.crash_times) < self.timing.crash_limit:
            return False
        n = len(self.crash_times)
        self._fail_permanently(
            f"{n} crash{'' if n == 1 else 'es'} within {self.timing.crash_window:.0f}s; last: {self.reason}")
        return True

    def _phase(self) -> str:
        """What the worker was doing when it died, for the crash reason."""
        if self.state is WorkerState.STARTING:
            return "loading"
        return "decoding" if self.inflight else "serving"

    @property
    def log_path(self) -> Path:
        return worker_log_path(self.log_dir, self.spec.model_id, self.spec.embedding)

    def _fail_permanently(self, reason: str) -> None:
        self.reason = reason
        if self.state is not WorkerState.CRASHED:
            # A load failure (a crash read it already): the worker's account is in its log.
            self.log_tail = read_log_tail(self.log_path, self._log_start)
        self._set_state(WorkerState.FAILED)
        self._fail_all("model_failed", reason)

    async def _backoff(self) -> bool:
        """Wait before a restart; True when a stop arrived meanwhile."""
        n = len(self.crash_times)
        delay = min(self.timing.backoff_max, self.timing.backoff_min * 2 ** max(0, n - 1))
        try:
            await asyncio.wait_for(self._stop_requested.wait(), delay)
            return True
        except TimeoutError:
            self.restarts += 1
            self.restarts_by_cause[self.cause or Cause.EXITED] += 1
            return False

    # ------------------------------------------------------------ one process

    async def _run_once(self) -> int | None:
        self.reason = None
        self.cause = None
        self._log_start = log_size(self.log_path)  # a crash shows only this process's lines
        try:
            reader = await self._spawn()
        except LoadFailed as exc:
            self.reason = str(exc)
            await self._reap()
            return EXIT_LOAD_FAILED
        except (HandshakeFailed, OSError, p.ProtocolError) as exc:
            self.reason = f"handshake failed: {exc}"
            self.cause = Cause.HANDSHAKE_FAILED
            await self._kill(signal.SIGKILL)
            return await self._reap()
        self._set_state(WorkerState.READY)
        self._kick()
        watchdog = asyncio.create_task(self._watch_liveness(), name="liveness")
        try:
            await self._read_loop(reader)
        finally:
            watchdog.cancel()
            await asyncio.gather(watchdog, return_exceptions=True)
        return await self._reap()

    def _socket_path(self) -> Path:
        path = self.run_dir / f"w{os.getpid()}-{id(self) % 100000}-{self.restarts}.sock"
        if len(str(path)) > MAX_SOCKET_PATH:
            raise OSError(f"socket path {path} is longer than {MAX_SOCKET_PATH} bytes; use a shorter state dir")
        return path

    async def _spawn(self) -> asyncio.StreamReader:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        sock = self._socket_path()
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

        Progress is the worker's resident memory against the model file size;
        the load fails when that stops growing for ``load_stall_timeout``
        (a big model may take minutes, a stuck one should not), or when the
        whole handshake takes longer than ``handshake_timeout``.
        """
        size = max(1, self.spec.path.stat().st_size if self.spec.path.exists() else 1)
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

    async def _exec(self, sock: Path) -> asyncio.subprocess.Process:
        s = self.spec
        args = [sys.executable, "-m", "worker", "--socket", str(sock), "--model", str(s.path),
                "--n-ctx", str(s.n_ctx), "--n-gpu-layers", str(s.n_gpu_layers),
                "--threads", str(s.n_threads), "--heartbeat", str(self.timing.heartbeat),
                "--parallel", str(max(1, s.parallel)), "--engine-socket", str(_engine_socket(sock))]
        if s.embedding:
            args.append("--embedding")
        if s.cache_type != "f16":
            args += ["--cache-type", s.cache_type]
        if s.draft_ngram > 0:
            args += ["--draft-ngram", str(s.draft_ngram)]
        if s.mmproj is not None:
            args += ["--mmproj", str(s.mmproj)]
        env = child_environ(os.environ)  # an allowlist: no token reaches a worker
        log_path = self.log_path
        _rotate(log_path)
        logfile = open(log_path, "ab")
        try:
            return await asyncio.create_subprocess_exec(
                *args, stdin=asyncio.subprocess.PIPE, stdout=logfile, stderr=logfile,
                start_new_session=True, env=env)
        finally:
            logfile.close()

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
        msg = self._codec.decode(body)
        if isinstance(msg, p.LoadFailed):
            raise LoadFailed(msg.reason)
        if not isinstance(msg, p.Hello):
            raise HandshakeFailed(f"expected hello, got {type(msg).__name__}")
        if msg.protocol_version != p.PROTOCOL_VERSION:
            raise LoadFailed(f"worker speaks protocol {msg.protocol_version}, parent {p.PROTOCOL_VERSION}")
        self.facts = msg.facts
        self.last_seen = self.clock()

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        while True:
            try:
                body = await p.read_frame(reader)
            except (p.ProtocolError, ConnectionError) as exc:
                # A hang already being killed breaks the stream too: keep the first cause.
                self.reason = self.reason or f"IPC stream broken: {exc}"
                self.cause = self.cause or Cause.IPC_BROKEN
                await self._kill(signal.SIGKILL)
                return
            if body is None:
                return
            try:
                msg = self._codec.decode(body)
            except p.InvalidMessage as exc:
                log.error("worker %s sent an invalid message: %s", self.spec.model_id, exc)
                continue
            self.last_seen = self.clock()
            self._route(msg)

    def _route(self, msg: p.FromWorker) -> None:
        match msg:
            case p.Heartbeat() | p.Pong():
                self.stats = msg.stats
            case p.Started() | p.Delta():
                pend = self.inflight.get(msg.id)
                if pend is not None:
                    pend.events.put_nowait(msg)
            case p.Done() | p.Tokens() | p.Embeddings():
                pend = self.inflight.get(msg.id)
                if pend is not None:
                    self._end(pend, msg)
            case p.Error():
                pend = self.inflight.get(msg.id)
                if pend is not None:
                    self._end(pend, msg)
                else:
                    log.error("worker %s: %s: %s", self.spec.model_id, msg.code, msg.message)
            case _:
                log.error("worker %s: unexpected %s", self.spec.model_id, type(msg).__name__)

    async def _watch_liveness(self) -> None:
        seq = 0
        while True:
            await asyncio.sleep(self.timing.ping_interval)
            if self.clock() - self.last_seen > self.timing.ping_timeout:
                self.reason = f"no answer to ping within {self.timing.ping_timeout:.0f}s (hung)"
                self.cause = Cause.HUNG
                log.error("worker %s hung; aborting it", self.spec.model_id)
                await self._kill(signal.SIGABRT)
                await asyncio.sleep(self.timing.kill_grace)
                await self._kill(signal.SIGKILL)
                return
            seq += 1
            self._send(p.Ping(seq))

    async def _kill(self, sig: int) -> None:
        if self._proc is not None and self._proc.returncode is None:
            self._sent_signals.add(sig)
            try:
                os.killpg(self._proc.pid, sig)
            except ProcessLookupError:
                pass  # already gone: nothing to kill

    async def _reap(self) -> int | None:
        """Close the connection and wait for the process; stop it if asked to."""
        proc = self._proc
        if self._writer is not None:
            if self._stop_requested.is_set() and not self._writer.is_closing():
                self._writer.write(self._codec.encode(p.Shutdown()))
            self._writer.close()
            self._writer = None
        if proc is None:
            return None
        try:
            await asyncio.wait_for(proc.wait(), self.timing.kill_grace)
        except TimeoutError:
            await self._kill(signal.SIGKILL)
            await proc.wait()
        # The group may hold helpers of the worker; none may outlive it.
        await self._kill_group_leftovers(proc.pid)
        # A killed engine leaves its listener's socket file behind.
        _engine_socket(self._socket_path()).unlink(missing_ok=True)
        self._proc = None
        return proc.returncode

    async def _kill_group_leftovers(self, pgid: int) -> None:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # the group is empty: the normal case

    # ------------------------------------------------------------ requests

    def submit(self, msg: p.Generate | p.Embed | p.Tokenize) -> Pending:
        if not self.accepting:
            raise NotAccepting(self.state, self.reason or self.state.value)
        if len(self.queue) >= self.queue_limit and (self._slots_full or self.state is not WorkerState.READY):
            raise QueueFull(f"{len(self.queue)} requests are already waiting for {self.spec.model_id}")
        msg.id = next(self._ids)
        pend = Pending(msg.id, msg)
        self.queue.append(pend)
        self.last_used = self.clock()
        self._kick()
        return pend

    def cancel(self, pend: Pending) -> None:
        if pend.finished:
            return
        if not pend.sent:
            self.queue.remove(pend)
            pend.finished = True
            self.changed.set()
            return
        self._send(p.Cancel(pend.id))

    @property
    def _slots_full(self) -> bool:
        return len(self.inflight) >= max(1, self.spec.parallel)

    def _kick(self) -> None:
        # Draining still serves what was queued before the drain began.
        while self.queue and not self._slots_full and self.state in (WorkerState.READY, WorkerState.DRAINING):
            self._send_next()

    def _send_next(self) -> None:
        pend = self.queue.popleft()
        try:
            frame = self._codec.encode(pend.msg)
        except (OverflowError, p.FrameTooLarge) as exc:
            # Not sendable (an int beyond 64 bits, a frame over the limit):
            # answer this request alone, never hold the worker's slot for it.
            self._end(pend, p.Error(pend.id, "invalid_request", f"the request cannot be sent to the worker: {exc}"))
            return
        pend.sent = True
        self.inflight[pend.id] = pend
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(frame)

    def _send(self, msg: msgspec.Struct) -> None:
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(self._codec.encode(msg))

    def _end(self, pend: Pending, event: p.FromWorker | WorkerGone) -> None:
        pend.finished = True
        pend.events.put_nowait(event)
        if self.inflight.get(pend.id) is pend:
            del self.inflight[pend.id]
        self.last_used = self.clock()
        self.changed.set()
        self._kick()

    def _fail_all(self, code: str, reason: str) -> None:
        for pend in list(self.inflight.values()):
            self._end(pend, WorkerGone(code, reason))
        while self.queue:
            pend = self.queue.popleft()
            pend.finished = True
            pend.events.put_nowait(WorkerGone(code, reason))
        self.changed.set()


def _engine_socket(ipc_socket: Path) -> Path:
    """The worker engine's own listener, beside our IPC socket (same length + 2)."""
    return ipc_socket.with_name(ipc_socket.stem + ".e.sock")


def _rss(pid: int) -> int:
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:
        return 0  # exited or not visible: the caller sees the exit itself


def _rotate(path: Path) -> None:
    """Keep one previous worker log once it grows past WORKER_LOG_MAX_BYTES
    (a line per request adds up over months of service)."""
    try:
        if path.stat().st_size > WORKER_LOG_MAX_BYTES:
            path.replace(path.with_name(path.name + ".1"))
    except FileNotFoundError:
        pass  # the first start of this model: nothing to rotate


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


# ------------------------------------------------------------ crash diagnostics

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
