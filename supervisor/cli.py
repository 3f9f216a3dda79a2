"""``gpuvisor`` command line: ``serve`` runs the parent process."""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import signal
import socket
import sys
from importlib import metadata
from typing import Any

import msgspec
import uvloop
from aiohttp import web

from supervisor import logs
from supervisor.api import proxies
from supervisor.app import build_app
from supervisor.appkeys import SHUTDOWN
from supervisor.config import Config, ConfigError, load_config
from supervisor.service import commands as service_cli
from supervisor.service import systemd

log = logging.getLogger("gpuvisor")


def _serve_args(sub: Any) -> None:
    sp = sub.add_parser("serve", help="run the service")
    sp.add_argument("--host", help="address to listen on (GPUVISOR_HOST)")
    sp.add_argument("--port", type=int, help="port to listen on; 0 picks a free one (GPUVISOR_PORT)")
    sp.add_argument("--state-dir", help="state directory (GPUVISOR_STATE_DIR)")
    sp.add_argument("--models-dir", help="directory of GGUF models (GPUVISOR_MODELS_DIR)")
    sp.add_argument("--config", help="TOML config file (GPUVISOR_CONFIG)")
    sp.add_argument("--log-level", help="debug, info, warning, error (GPUVISOR_LOG_LEVEL)")


class Shutdown:
    """Signal handlers only record the signal; the serve loop acts on it."""

    def __init__(self) -> None:
        self.requested = asyncio.Event()
        self.hurry = asyncio.Event()  # a second signal: shorten the shutdown
        self.count = 0

    def handle(self, signum: int) -> None:
        self.count += 1
        log.info("received %s (%d)", signal.Signals(signum).name, self.count)
        self.requested.set()
        if self.count >= 2:
            self.hurry.set()


def _drain_bound(cfg: Config) -> float:
    """How long a clean shutdown may take: streams, then jobs and workers."""
    return cfg.shutdown_timeout * 2 + cfg.job_grace_s + cfg.kill_grace * 2 + 10


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


async def serve(cfg: Config) -> int:
    try:
        sock = listen_socket(cfg.host, cfg.port)
    except ListenError as exc:
        print(f"gpuvisor: {exc}", file=sys.stderr)
        return 1
    loop = asyncio.get_running_loop()
    stop = Shutdown()
    # Read and remove NOTIFY_SOCKET: no child may notify systemd in our name.
    notifier = systemd.Notifier.from_environ(os.environ)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.handle, sig)
    app = build_app(cfg)
    stop.hurry = app[SHUTDOWN].hurry
    # handler_cancellation: a client that disconnects cancels its handler,
    # which cancels its generation in the worker even during a silent prefill.
    # The guard bounds the time to send headers and the connections per client.
    runner = proxies.GuardedRunner(app, proxies.ConnectionGuard.from_config(cfg), handler_cancellation=True,
                                   access_log=None, shutdown_timeout=cfg.shutdown_timeout,
                                   keepalive_timeout=cfg.keepalive_timeout)
    # setup() runs the cleanup contexts: database open, boot recovery, lab.
    await runner.setup()
    keepalive: asyncio.Task[None] | None = None
    extend: asyncio.Task[None] | None = None
    try:
        site = web.SockSite(runner, sock)
        await site.start()
        port = runner.addresses[0][1]
        # Tests and scripts read this line to learn the port when it was 0.
        print(f"gpuvisor listening on http://{cfg.host}:{port}", flush=True)
        print(f"lab UI: {service_cli.local_url(cfg.host, port)}/", flush=True)
        log.info("state dir %s, models dir %s", cfg.state_dir, cfg.models_dir)
        notifier.ready(systemd.service_status(app))
        keepalive = asyncio.create_task(systemd.keepalive(
            notifier, lambda: systemd.healthy(app, timeout=5.0), lambda: systemd.service_status(app)),
            name="sd-keepalive")
        await stop.requested.wait()
        log.info("shutting down: no new requests; streams get up to %.0fs", cfg.shutdown_timeout)
        notifier.stopping("stopping: draining requests and jobs")
        extend = asyncio.create_task(systemd.extend_while(notifier, _drain_bound(cfg)), name="sd-extend")
    finally:
        await _end_task(keepalive)
        await runner.cleanup()
        await _end_task(extend)
        notifier.close()
        sock.close()
    log.info("stopped")
    return 0


async def _end_task(task: asyncio.Task[None] | None) -> None:
    if task is None:
        return
    task.cancel()
    (result,) = await asyncio.gather(task, return_exceptions=True)
    if isinstance(result, Exception):
        log.error("%s had failed: %r", task.get_name(), result)


def auth_off_problem(cfg: Config) -> str | None:
    """Why ``auth = "off"`` on a non-loopback address is refused at start:
    keys or an admin token configured beside it do not protect anything then
    (the exposure check alone would let it start, to refuse every request)."""
    if cfg.auth != "off" or service_cli.is_loopback(cfg.host) or cfg.allow_unauthenticated:
        return None
    return (f'refusing to listen on {cfg.host} with auth = "off": anyone who can reach it could run '
            'models and jobs; remove auth = "off" (and configure a key), keep host = 127.0.0.1, or on a '
            "network you trust completely set allow_unauthenticated = true")


def auth_off_warning(cfg: Config) -> str | None:
    """One line for an allowed ``auth = "off"`` on a non-loopback address."""
    if cfg.auth != "off" or service_cli.is_loopback(cfg.host):
        return None
    return (f'authentication is off (auth = "off") and the service listens on {cfg.host}: anyone who '
            "can reach it can use it (allow_unauthenticated = true)")


_CONFIG_FIELDS = {f.name for f in msgspec.structs.fields(Config)}


def _version() -> str:
    try:
        return metadata.version("gpuvisor")
    except metadata.PackageNotFoundError:
        return "dev"  # run from a checkout that was never installed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpuvisor")
    ap.add_argument("--version", action="version", version=f"gpuvisor {_version()}")
    sub = ap.add_subparsers(dest="command", required=True)
    _serve_args(sub)
    service_cli.add_subcommands(sub)
    args = ap.parse_args(argv)
    cli = {k: v for k, v in vars(args).items() if k in _CONFIG_FIELDS}
    try:
        cfg = load_config(cli)
        service_cli.check_settings(cfg)
    except ConfigError as exc:
        print(f"gpuvisor: {exc}", file=sys.stderr)
        return 2
    logs.configure(cfg.log_level, cfg.log_format, [cfg.admin_token, cfg.hf_token])
    if args.command == "serve":
        problem = auth_off_problem(cfg) or service_cli.exposure_problem(cfg)
        if problem is not None:
            print(f"gpuvisor: {problem}", file=sys.stderr)
            return 2
        warning = auth_off_warning(cfg)
        if warning is not None:
            print(f"gpuvisor: warning: {warning}", file=sys.stderr, flush=True)
        return uvloop.run(serve(cfg))
    return service_cli.run(args, cfg)


if __name__ == "__main__":
    sys.exit(main())
