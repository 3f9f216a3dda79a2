"""``gpuvisor`` command line: ``serve`` runs the parent process."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import Any

import uvloop
from aiohttp import web

from supervisor.app import build_app
from supervisor.config import Config, ConfigError, load_config

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
        self.count = 0

    def handle(self, signum: int) -> None:
        self.count += 1
        log.info("received %s (%d)", signal.Signals(signum).name, self.count)
        self.requested.set()


async def serve(cfg: Config) -> int:
    loop = asyncio.get_running_loop()
    stop = Shutdown()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.handle, sig)
    app = build_app(cfg)
    # handler_cancellation: a client that disconnects cancels its handler,
    # which cancels its generation in the worker even during a silent prefill.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=cfg.shutdown_timeout)
    await runner.setup()
    try:
        site = web.TCPSite(runner, cfg.host, cfg.port)
        await site.start()
        port = runner.addresses[0][1]
        # Tests and scripts read this line to learn the port when it was 0.
        print(f"gpuvisor listening on http://{cfg.host}:{port}", flush=True)
        log.info("state dir %s, models dir %s", cfg.state_dir, cfg.models_dir)
        await stop.requested.wait()
        log.info("shutting down: no new requests; streams get up to %.0fs", cfg.shutdown_timeout)
    finally:
        await runner.cleanup()
    log.info("stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpuvisor")
    sub = ap.add_subparsers(dest="command", required=True)
    _serve_args(sub)
    args = ap.parse_args(argv)
    cli = {k: v for k, v in vars(args).items() if k != "command"}
    try:
        cfg = load_config(cli)
    except ConfigError as exc:
        print(f"gpuvisor: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        return uvloop.run(serve(cfg))
    return 2


if __name__ == "__main__":
    sys.exit(main())
