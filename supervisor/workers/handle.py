"""One model worker as the parent sees it: the policy around its process.

A ``WorkerHandle`` supervises a worker: it spawns its process through a
launcher (supervisor/workers/process.py, launcher.py; local unless told
otherwise), gets back a proven connection (connection.py), watches it
(ping/pong), and restarts it with
backoff, counting crashes by cause. Its requests wait and run in a
``RequestQueue`` (supervisor/workers/queue.py): up to ``spec.parallel`` in
flight at once (the worker's engine slots), the rest queued. Requests queued
but not yet sent survive a crash and go to the restarted worker; those in
flight end with a ``WorkerGone`` event. State lives in one enum, not in flags.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import signal
from collections import deque
from collections.abc import Callable
from pathlib import Path

from supervisor.workers.connection import Connection, Endpoint
from supervisor.workers.crash import (
    exit_is_news,
    exit_reason,
    load_failure_reason,
    worker_log_path,
)
from supervisor.workers.launcher import Launcher, LocalLauncher
from supervisor.workers.process import HandshakeFailed, LoadFailed, WorkerProcess
from supervisor.workers.queue import Pending, RequestQueue
from supervisor.workers.spec import Timing, WorkerSpec
from worker import protocol as p

# worker_log_path: the routes name a model's log by it, beside its state.
__all__ = ["Cause", "NotAccepting", "WorkerHandle", "WorkerState", "worker_log_path"]

log = logging.getLogger("gpuvisor.worker")

EXIT_LOAD_FAILED = p.EXIT_LOAD_FAILED


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


class NotAccepting(Exception):
    """The handle takes no new requests (draining, stopping or failed)."""

    def __init__(self, state: WorkerState, reason: str) -> None:
        super().__init__(reason)
        self.state = state
        self.reason = reason


# States in which queued requests go to the worker (draining still serves
# what was queued before the drain began).
_DISPATCHING = (WorkerState.READY, WorkerState.DRAINING)


class WorkerHandle:
    def __init__(self, spec: WorkerSpec, timing: Timing, run_dir: Path, log_dir: Path,
                 queue_limit: int, clock: Callable[[], float] | None = None, *,
                 queue_timeout: float = 0.0,
                 launcher: Launcher | None = None, endpoint: Endpoint | None = None) -> None:
        self.spec = spec
        self.timing = timing
        self.run_dir = run_dir
        self.log_dir = log_dir
        self.queue_limit = queue_limit
        self.clock = clock or asyncio.get_running_loop().time
        self.state = WorkerState.STARTING
        self.reason: str | None = None
        self.restarts = 0
        self.restarts_by_cause: dict[Cause, int] = dict.fromkeys(Cause, 0)
        self.cause: Cause | None = None
        self.last_seen = self.clock()
        # Seconds to stay loaded after the last request; negative = forever.
        self.keep_alive = 300.0
        # The enable_thinking template variable of a request that sets none
        # (the model's enable_thinking setting); None = the template's default.
        self.enable_thinking: bool | None = None
        self.stats: p.WorkerStats | None = None
        self.crash_times: deque[float] = deque()
        # Whether a crash counts toward crash_limit, given the requests in flight
        # (the pool's poison-request rule, supervisor/workers/poison.py).
        self.crash_counts: Callable[[list[Pending]], bool] = lambda _in_flight: True
        # Told when the worker is marked failed (its process is gone for good):
        # the pool then takes it off the lease's books, and keeps it in its own.
        self.on_failed: Callable[[], None] = lambda: None
        self.ready = asyncio.Event()
        self.changed = asyncio.Event()
        self.process = WorkerProcess(spec, timing, run_dir, launcher or LocalLauncher(run_dir, log_dir),
                                     endpoint or Endpoint(), self.clock, id(self))
        self.requests = RequestQueue(spec.model_id, spec.parallel, queue_limit, self.process,
                                     self.clock, self.changed, lambda: self.state in _DISPATCHING,
                                     wait_limit=queue_timeout)
        self._stop_requested = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # The log's last lines at the last crash or failure.
        self.log_tail: str | None = None

    # ------------------------------------------------------------ views

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def facts(self) -> p.ModelFacts | None:
        return self.process.facts

    @property
    def load_progress(self) -> float | None:
        return self.process.load_progress

    @property
    def queue(self) -> deque[Pending]:
        return self.requests.waiting

    @property
    def inflight(self) -> dict[int, Pending]:
        return self.requests.inflight

    @property
    def last_used(self) -> float:
        return self.requests.last_used

    @last_used.setter
    def last_used(self, value: float) -> None:
        self.requests.last_used = value

    @property
    def log_path(self) -> Path:
        return self.process.log_path

    @property
    def busy(self) -> bool:
        return self.requests.busy

    @property
    def accepting(self) -> bool:
        return self.state in (WorkerState.STARTING, WorkerState.READY, WorkerState.CRASHED)

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name=f"worker:{self.spec.model_id}")

    async def stop(self, reason: str = "stopped", code: str = "worker_stopped") -> None:
        """Stop the worker now; every pending request ends with ``code``."""
        if self.state not in (WorkerState.FAILED, WorkerState.STOPPED):
            self._set_state(WorkerState.STOPPING)
        self._stop_requested.set()
        self.requests.fail_all(code, reason)
        self.process.send(p.Shutdown())
        task = self._task
        if task is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(task), self.timing.kill_grace * 2)
        except TimeoutError:
            # Stuck before the handshake or in a hung worker: kill the group.
            self.process.kill(signal.SIGKILL)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await self.process.wait()
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
            if self.process.host_lost() and self.inflight and await self._await_node_verdict():
                break
            if code == EXIT_LOAD_FAILED or self.state is WorkerState.FAILED:
                self._fail_permanently(load_failure_reason(self.reason))
                log.error("cannot load %s: %s (its log: %s)", self._label(), self.reason, self.log_path)
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
        signalled_by_us = code is not None and -code in self.process.sent_signals
        self.process.sent_signals.clear()
        # The parent's own account (a hang, a broken stream) is kept unless the
        # exit status says more; it does not say whose crash it was.
        parents_account = self.reason is not None and not exit_is_news(code, signalled_by_us)
        self.reason = exit_reason(code, self._phase(), self.reason, signalled_by_us)
        self.cause = self.cause or Cause.EXITED
        self.log_tail = self.process.log_tail()
        log.warning("worker %s: %s (its log: %s)", self.spec.model_id, self.reason, self.log_path)
        self._set_state(WorkerState.CRASHED)
        self.requests.end_inflight("worker_crashed", f"the model worker crashed ({self.reason})"
                                   if parents_account else self.reason)
        if len(self.crash_times) < self.timing.crash_limit:
            return False
        n = len(self.crash_times)
        self._fail_permanently(
            f"{n} crash{'' if n == 1 else 'es'} within {self.timing.crash_window:.0f}s; last: {self.reason}")
        return True

    async def _await_node_verdict(self) -> bool:
        """The worker ended with its node's agent: its requests in flight wait
        for the cluster to declare the node dead, when the pool stops this
        handle with ``node_lost`` (its node-loss handling), rather
        than end at once as a crash. True when that stop came; False after
        the bound (an agent gone on a node that lives: a crash after all)."""
        self._set_state(WorkerState.CRASHED)
        try:
            await asyncio.wait_for(self._stop_requested.wait(), self.timing.node_verdict_s)
        except TimeoutError:
            return False
        return True

    def _phase(self) -> str:
        """What the worker was doing when it died, for the crash reason."""
        if self.state is WorkerState.STARTING:
            return "loading"
        return "decoding" if self.inflight else "serving"

    def _fail_permanently(self, reason: str) -> None:
        self.reason = reason
        if self.state is not WorkerState.CRASHED:
            # A load failure (a crash read it already): the worker's account is in its log.
            self.log_tail = self.process.log_tail()
        self._set_state(WorkerState.FAILED)
        self.requests.fail_all("model_failed", reason)
        self.on_failed()

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

    def _label(self) -> str:
        return f"{self.spec.model_id}{' (embedding)' if self.spec.embedding else ''}"

    async def _run_once(self) -> int | None:
        self.reason = None
        self.cause = None
        started = self.clock()
        # Loads take seconds to minutes: the log says when one starts and how it ended.
        log.info("%s %s: n_ctx %d, %d slot%s, on %s", "restarting" if self.restarts else "loading",
                 self._label(), self.spec.n_ctx, self.spec.parallel, "" if self.spec.parallel == 1 else "s",
                 ", ".join(self.spec.devices) or self.spec.device)
        try:
            conn = await self.process.spawn(self.restarts)
        except LoadFailed as exc:
            self.reason = str(exc)
            await self._reap()
            return EXIT_LOAD_FAILED
        except (HandshakeFailed, OSError, p.ProtocolError) as exc:
            self.reason = f"handshake failed: {exc}"
            self.cause = Cause.HANDSHAKE_FAILED
            self.process.kill(signal.SIGKILL)
            return await self._reap()
        self.last_seen = self.clock()
        self._set_state(WorkerState.READY)
        log.info("%s ready in %.1fs (pid %s)", self._label(), self.last_seen - started, self.pid)
        self.requests.kick()
        watchdog = asyncio.create_task(self._watch_liveness(), name="liveness")
        try:
            await self._read_loop(conn)
        finally:
            watchdog.cancel()
            await asyncio.gather(watchdog, return_exceptions=True)
        return await self._reap()

    async def _reap(self) -> int | None:
        """Close the connection and wait for the process; stop it if asked to."""
        return await self.process.reap(shutdown=self._stop_requested.is_set())

    async def _read_loop(self, conn: Connection) -> None:
        while True:
            try:
                msg = await conn.read()
            except p.InvalidMessage as exc:
                log.error("worker %s sent an invalid message: %s", self.spec.model_id, exc)
                continue
            except (p.ProtocolError, ConnectionError) as exc:
                # A hang already being killed breaks the stream too: keep the first cause.
                self.reason = self.reason or f"IPC stream broken: {exc}"
                self.cause = self.cause or Cause.IPC_BROKEN
                self.process.kill(signal.SIGKILL)
                return
            if msg is None:
                return
            self.last_seen = self.clock()
            if isinstance(msg, p.Heartbeat | p.Pong):
                self.stats = msg.stats
            else:
                self.requests.deliver(msg)

    async def _watch_liveness(self) -> None:
        seq = 0
        while True:
            await asyncio.sleep(self.timing.ping_interval)
            if self.clock() - self.last_seen > self.timing.ping_timeout:
                self.reason = f"no answer to ping within {self.timing.ping_timeout:.0f}s (hung)"
                self.cause = Cause.HUNG
                log.error("worker %s hung; aborting it", self.spec.model_id)
                self.process.kill(signal.SIGABRT)
                await asyncio.sleep(self.timing.kill_grace)
                self.process.kill(signal.SIGKILL)
                return
            seq += 1
            self.process.send(p.Ping(seq))

    # ------------------------------------------------------------ requests

    def submit(self, msg: p.Generate | p.Embed | p.Tokenize, caller: str = "") -> Pending:
        if not self.accepting:
            raise NotAccepting(self.state, self.reason or self.state.value)
        return self.requests.add(msg, ready=self.state is WorkerState.READY, caller=caller)

    def cancel(self, pend: Pending) -> None:
        self.requests.cancel(pend)
