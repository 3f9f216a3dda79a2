"""One model worker as a process the parent started: spawn, handshake, end.

``WorkerProcess`` runs the spawns of one handle, one at a time: it opens a
listener for the spawn (supervisor/workers/connection.py), has its launcher
(supervisor/workers/launcher.py; local by default) start ``python -m
worker`` with the listener's address and a fresh secret, waits for the
worker to prove itself and load its model while reporting load progress,
and later signals, reaps and cleans up after it. It decides nothing:
restarts, liveness and request routing belong to the handle
(supervisor/workers/handle.py).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from supervisor.workers.connection import Connection, Endpoint, Listener
from supervisor.workers.launcher import Launcher, Started, socket_path
from supervisor.workers.spec import Timing, WorkerSpec
from worker import protocol as p


class HandshakeFailed(Exception):
    pass


class LoadFailed(Exception):
    pass


class WorkerProcess:
    """The current worker process of one handle (one at a time, many over restarts)."""

    def __init__(self, spec: WorkerSpec, timing: Timing, run_dir: Path, launcher: Launcher,
                 endpoint: Endpoint, clock: Callable[[], float], tag: int) -> None:
        self.spec = spec
        self.timing = timing
        self.run_dir = run_dir
        self.launcher = launcher
        self.endpoint = endpoint
        self.clock = clock
        self.tag = tag  # tells this handle's sockets from another's in run_dir
        self.pid: int | None = None
        self.facts: p.ModelFacts | None = None
        self.load_progress: float | None = None
        self.codec = p.parent_codec()
        self._started: Started | None = None
        self._last: Started | None = None  # the reaped one, whose log lines a crash shows
        self._conn: Connection | None = None
        # The signals we sent this process (a signal we sent is not the worker's own crash).
        self.sent_signals: set[int] = set()

    @property
    def log_path(self) -> Path:
        return self.launcher.log_path(self.spec)

    def log_tail(self) -> str:
        """The current process's last lines in the log."""
        started = self._started or self._last
        return started.log_tail() if started is not None else ""

    def host_lost(self) -> bool:
        """Did the last process end with its node's agent (launcher.Started.host_lost)?"""
        started = self._started or self._last
        return started is not None and started.host_lost

    # ------------------------------------------------------------ writing

    def encode(self, msg: msgspec.Struct) -> bytes:
        return self.codec.encode(msg)

    def write(self, frame: bytes) -> None:
        """Write a frame if connected; a frame to a dead worker is dropped (its crash says why)."""
        if self._conn is not None:
            self._conn.write(frame)

    def send(self, msg: msgspec.Struct) -> None:
        if self._conn is not None:
            self._conn.send(msg)

    # ------------------------------------------------------------ start

    async def spawn(self, generation: int) -> Connection:
        """Start a process and finish its handshake; the connection carries its messages."""
        stem = f"w{os.getpid()}-{self.tag % 100000}-{generation}"
        secret = secrets.token_bytes(p.SECRET_BYTES)
        listener = Listener(self.endpoint, secret, self.spec.model_id)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            unix = self.endpoint.transport == "unix"
            await listener.open(socket_path(self.run_dir, stem) if unix else None)
            started = self._started = await self.launcher.start(self.spec, self.timing, listener.address,
                                                                secret, stem)
            self.pid = started.pid
            try:
                await self._wait_loading(started, listener.proven, "no worker proved itself")
            except HandshakeFailed as exc:
                if listener.last_refusal:
                    raise HandshakeFailed(f"{exc} (last refused connection: {listener.last_refusal})") from exc
                raise
            conn = self._conn = listener.proven.result()
        finally:
            listener.close()
        if conn.hello.protocol_version != p.PROTOCOL_VERSION:
            self.kill(signal.SIGKILL)  # it would load a model it cannot serve
            raise LoadFailed(f"worker speaks protocol {conn.hello.protocol_version}, parent {p.PROTOCOL_VERSION}")
        await self._ready(started, conn)
        return conn

    async def _ready(self, started: Started, conn: Connection) -> None:
        """Wait for the worker's Ready (its model loaded) or LoadFailed."""
        first = asyncio.ensure_future(conn.read())
        try:
            await self._wait_loading(started, first, "no ready within the handshake timeout")
        finally:
            self.load_progress = None
        msg = first.result()
        if msg is None:
            raise HandshakeFailed("worker closed the connection before it was ready")
        if isinstance(msg, p.LoadFailed):
            raise LoadFailed(msg.reason)
        if not isinstance(msg, p.Ready):
            raise HandshakeFailed(f"expected ready, got {type(msg).__name__}")
        self.facts = msg.facts

    async def _wait_loading(self, started: Started, waited: asyncio.Future[Any], late: str) -> None:
        """Wait for ``waited`` (the proven connection, then Ready), reporting load progress.

        Progress is the worker's resident memory against the size of the
        model's files (every shard: :func:`load_size`); the load fails when
        that stops growing for ``load_stall_timeout`` (a big model may take
        minutes, a stuck one should not), or when the whole handshake takes
        longer than ``handshake_timeout`` (``late`` says so).
        """
        size = load_size(self.spec)
        exited = asyncio.ensure_future(started.wait())
        start = last_growth = self.clock()
        last_rss = 0
        self.load_progress = 0.0
        try:
            while not waited.done():
                done, _ = await asyncio.wait({waited, exited}, timeout=0.25,
                                             return_when=asyncio.FIRST_COMPLETED)
                if exited in done and not waited.done():
                    raise HandshakeFailed("worker exited during its handshake")
                rss = started.rss()
                now = self.clock()
                if rss > last_rss:
                    last_rss, last_growth = rss, now
                    self.load_progress = min(0.99, rss / size)
                if now - last_growth > self.timing.load_stall_timeout:
                    raise HandshakeFailed(
                        f"loading stalled: no progress for {self.timing.load_stall_timeout:.0f}s")
                if now - start > self.timing.handshake_timeout:
                    raise HandshakeFailed(f"{late} within the handshake timeout")
        finally:
            exited.cancel()
            if not waited.done():
                waited.cancel()

    # ------------------------------------------------------------ end

    def kill(self, sig: int) -> None:
        """Signal the process's group, if the process still runs."""
        if self._started is not None and self._started.returncode is None:
            self.sent_signals.add(sig)
            self._started.kill(sig)

    async def wait(self) -> None:
        if self._started is not None:
            await self._started.wait()

    async def reap(self, shutdown: bool) -> int | None:
        """Close the connection (saying Shutdown first if ``shutdown``) and wait for the process."""
        started = self._started
        if self._conn is not None:
            if shutdown:
                self._conn.send(p.Shutdown())
            self._conn.close()
            self._conn = None
        if started is None:
            return None
        try:
            await asyncio.wait_for(started.wait(), self.timing.kill_grace)
        except TimeoutError:
            self.kill(signal.SIGKILL)
            await started.wait()
        started.cleanup()
        self._started, self._last = None, started
        return started.returncode


def load_size(spec: WorkerSpec) -> int:
    """The bytes a worker loads: all of the model's files as the library
    counted them, else (a spec made without it) the size of its path."""
    if spec.model_bytes > 0:
        return spec.model_bytes
    try:
        return max(1, spec.path.stat().st_size)
    except OSError:
        return 1  # gone or unreadable: the worker's load fails and says why
