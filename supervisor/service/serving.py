"""``gpuvisor serve``: the listening socket, the signals and the stop order.

:class:`Service` owns one serving run, gunicorn's way: the signal handlers
only queue the signal, and one dispatcher task calls ``handle_<name>()``:

- SIGTERM / SIGINT: the first stops serving (the listener closes, streams
  drain, jobs are asked to checkpoint; ``app.on_shutdown``), a second cuts
  that short (workers stopped and jobs killed now);
- SIGHUP: the models dirs are scanned again (``systemctl reload``).

The stop order is aiohttp's: ``on_shutdown`` (the drain), then the cleanup
contexts in reverse (job runner, worker pool, lease, library, database).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable

from aiohttp import web

from supervisor.api import proxies
from supervisor.app import build_app
from supervisor.appkeys import LIBRARY, SHUTDOWN
from supervisor.config import Config
from supervisor.service import commands as service_cli
from supervisor.service import systemd
from supervisor.service.state_lock import StateDirBusy, StateLock

log = logging.getLogger("gpuvisor")

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class ListenError(Exception):
    pass


def listen_socket(host: str, port: int) -> socket.socket:
    """The service's listening socket, bound before anything starts (a worker
    started for nothing, then a page of traceback, was the old way to learn
    that the port is taken). ListenError says what to do instead."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                   flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise ListenError(f"cannot listen on {host!r}: {exc.strerror} (check --host)") from exc
    try:
        return socket.create_server(addr, family=family, backlog=1024)
    except OSError as exc:
        raise ListenError(_listen_problem(host, port, exc)) from exc


def _listen_problem(host: str, port: int, exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return f"port {port} is in use (is gpuvisor already running? use --port)"
    if exc.errno == errno.EACCES:
        return f"cannot listen on port {port}: permission denied (ports below 1024 need privileges; use --port)"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"cannot listen on {host}: not an address of this machine (check --host)"
    return f"cannot listen on {host}:{port}: {exc.strerror or exc}"


def drain_bound(cfg: Config) -> float:
    """How long a clean shutdown may take: streams, then jobs and workers."""
    return cfg.shutdown_timeout * 2 + cfg.job_grace_s + cfg.kill_grace * 2 + 10


class Service:
    """One serving run: the app, its runner and the dispatch of signals."""

    def __init__(self, cfg: Config, app: web.Application, notifier: systemd.Notifier,
                 state_lock: StateLock | None = None) -> None:
        self.cfg = cfg
        self.app = app
        self.notifier = notifier
        self.state_lock = state_lock
        self.stopping = asyncio.Event()
        self._signals: asyncio.Queue[signal.Signals] = asyncio.Queue()
        self._stop_signals = 0
        self._rescan: asyncio.Task[None] | None = None

    # ------------------------------------------------------------ signals

    def on_signal(self, signum: int) -> None:
        """The loop's signal handler: record, nothing else."""
        self._signals.put_nowait(signal.Signals(signum))

    async def dispatch_signals(self) -> None:
        handlers: dict[signal.Signals, Callable[[], None]] = {
            signal.SIGTERM: self.handle_term, signal.SIGINT: self.handle_int, signal.SIGHUP: self.handle_hup}
        while True:
            handlers[await self._signals.get()]()

    def handle_term(self) -> None:
        self._stop_requested("SIGTERM")

    def handle_int(self) -> None:
        self._stop_requested("SIGINT")

    def handle_hup(self) -> None:
        library = self.app.get(LIBRARY)
        if library is None:
            log.info("received SIGHUP before the model library exists; nothing to rescan")
            return
        if self._rescan is not None and not self._rescan.done():
            log.info("received SIGHUP: a rescan is already running")
            return
        log.info("received SIGHUP: scanning the models dirs again")
        # In a thread: a scan reads headers from disk. The library serialises
        # scans itself (its watcher may be scanning too).
        self._rescan = asyncio.create_task(asyncio.to_thread(library.rescan), name="sighup-rescan")

    def _stop_requested(self, name: str) -> None:
        self._stop_signals += 1
        log.info("received %s (%d)", name, self._stop_signals)
        if self._stop_signals == 1:
            self.stopping.set()
        else:
            self.app[SHUTDOWN].hurry.set()

    @property
    def rescan_task(self) -> asyncio.Task[None] | None:
        return self._rescan

    # ------------------------------------------------------------ serving

    async def run(self, sock: socket.socket) -> None:
        cfg = self.cfg
        # handler_cancellation: a client that disconnects cancels its handler,
        # which cancels its generation in the worker even during a silent prefill.
        # The guard bounds the time to send headers and the connections per client.
        runner = proxies.GuardedRunner(self.app, proxies.ConnectionGuard.from_config(cfg),
                                       handler_cancellation=True, access_log=None,
                                       shutdown_timeout=cfg.shutdown_timeout,
                                       keepalive_timeout=cfg.keepalive_timeout)
        keepalive: asyncio.Task[None] | None = None
        extend: asyncio.Task[None] | None = None
        try:
            # setup() enters the cleanup contexts (database, boot recovery,
            # lab); if one fails, cleanup() unwinds those already entered.
            await runner.setup()
            await web.SockSite(runner, sock).start()
            self._announce(runner.addresses[0][1])
            keepalive = asyncio.create_task(systemd.keepalive(
                self.notifier, lambda: systemd.healthy(self.app, timeout=5.0),
                lambda: systemd.service_status(self.app)), name="sd-keepalive")
            await self.stopping.wait()
            # The drain (app.on_shutdown) logs what it waits for.
            self.notifier.stopping("stopping: draining requests and jobs")
            extend = asyncio.create_task(systemd.extend_while(self.notifier, drain_bound(cfg)),
                                         name="sd-extend")
        finally:
            await end_task(keepalive)
            await runner.cleanup()
            await end_task(extend)

    def _announce(self, port: int) -> None:
        # Tests and scripts read this line to learn the port when it was 0.
        print(f"gpuvisor listening on http://{self.cfg.host}:{port}", flush=True)
        url = service_cli.local_url(self.cfg.host, port)
        print(f"lab UI: {url}/", flush=True)
        if self.state_lock is not None:
            self.state_lock.record_url(url)
        log.info("state dir %s, models dir %s", self.cfg.state_dir, self.cfg.models_dir)
        self.notifier.ready(systemd.service_status(self.app))


async def serve(cfg: Config) -> int:
    # First the state dir (before the database, the demo model or the port):
    # a second parent on it would share the database and the jobs. Taken
    # synchronously: nothing else runs on the loop yet.
    lock = StateLock(cfg.state_path)
    try:
        lock.acquire()
    except StateDirBusy as exc:
        print(f"gpuvisor: {exc}", file=sys.stderr)
        return 1
    try:
        return await _serve_locked(cfg, lock)
    finally:
        lock.release()


async def _serve_locked(cfg: Config, lock: StateLock) -> int:
    try:
        sock = listen_socket(cfg.host, cfg.port)
    except ListenError as exc:
        print(f"gpuvisor: {exc}", file=sys.stderr)
        return 1
    loop = asyncio.get_running_loop()
    # Read and remove NOTIFY_SOCKET: no child may notify systemd in our name.
    notifier = systemd.Notifier.from_environ(os.environ)
    service = Service(cfg, build_app(cfg), notifier, lock)
    for sig in SIGNALS:
        loop.add_signal_handler(sig, service.on_signal, sig)
    dispatcher = asyncio.create_task(service.dispatch_signals(), name="signals")
    try:
        await service.run(sock)
    finally:
        await end_task(dispatcher)
        await end_task(service.rescan_task)
        for sig in SIGNALS:
            loop.remove_signal_handler(sig)
        notifier.close()
        sock.close()
    log.info("stopped")
    return 0


async def end_task(task: asyncio.Task[None] | None) -> None:
    """Cancel a task this module owns and log how it had ended."""
    if task is None:
        return
    task.cancel()
    (result,) = await asyncio.gather(task, return_exceptions=True)
    if isinstance(result, Exception):
        log.error("%s had failed: %r", task.get_name(), result)
