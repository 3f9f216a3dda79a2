"""``gpuvisor`` command line: settings and sub-commands (``serve`` is in
:mod:`supervisor.service.serving`)."""

from __future__ import annotations

import argparse
import sys
from importlib import metadata
from typing import Any

import msgspec
import uvloop

from supervisor import logs
from supervisor.config import Config, ConfigError, load_config
from supervisor.service import commands as service_cli
from supervisor.service.serving import serve


def _serve_args(sub: Any) -> None:
    sp = sub.add_parser("serve", help="run the service")
    sp.add_argument("--host", help="address to listen on (GPUVISOR_HOST)")
    sp.add_argument("--port", type=int, help="port to listen on; 0 picks a free one (GPUVISOR_PORT)")
    sp.add_argument("--state-dir", help="state directory (GPUVISOR_STATE_DIR)")
    sp.add_argument("--models-dir", help="directory of GGUF models (GPUVISOR_MODELS_DIR)")
    sp.add_argument("--config", help="TOML config file (GPUVISOR_CONFIG)")
    sp.add_argument("--log-level", help="debug, info, warning, error (GPUVISOR_LOG_LEVEL)")


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
