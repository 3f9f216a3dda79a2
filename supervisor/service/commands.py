"""``gpuvisor status``, ``gpuvisor keys ...``, ``gpuvisor install-systemd``,
and the exposure check ``serve`` runs before it listens."""

from __future__ import annotations

import argparse
import asyncio
import grp
import ipaddress
import os
import pwd
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from supervisor import logs
from supervisor.api import proxies
from supervisor.api.auth import KeyStore, hash_secret, new_api_key, parse_config_keys
from supervisor.config import Config, ConfigError
from supervisor.db import Database
from supervisor.errors import ApiError
from supervisor.service import key_advice, pull
from supervisor.service.state_lock import holder


def add_subcommands(sub: Any) -> None:
    st = sub.add_parser("status", help="print a summary from the running service")
    st.add_argument("--url", help="service URL (default: from host/port in the config)")
    st.add_argument("--token", help="admin token or API key (default: GPUVISOR_TOKEN, then admin_token)")
    keys = sub.add_parser("keys", help="manage API keys").add_subparsers(dest="keys_command", required=True)
    add = keys.add_parser("add", help="create a key; it is printed once")
    add.add_argument("name")
    add.add_argument("--print-config", action="store_true",
                     help="print an api_keys entry for the config file instead of storing the key")
    keys.add_parser("list", help="list active keys")
    rev = keys.add_parser("revoke", help="revoke a key by name or id")
    rev.add_argument("name")
    keys.add_parser("admin-token", help="create an admin token and print its hash for the config")
    pl = pull.add_subcommand(sub)
    inst = sub.add_parser("install-systemd", help="write the systemd unit, config skeleton and user")
    inst.add_argument("--root", default="/", help="install under this root (for packaging)")
    inst.add_argument("--exec", dest="exec_path", help="the gpuvisor executable (default: this one)")
    inst.add_argument("--user", default="gpuvisor", help="service user (created if missing)")
    inst.add_argument("--gpu", default="auto",
                      help="GPU device nodes the unit allows: auto (those of the installed engine "
                           "and torch builds), none, or a comma list of nvidia, rocm, vulkan")
    # The same settings as serve, so that a service started with flags is
    # found with the same flags (or the same config file and environment).
    for sp in (st, pl, inst, *keys.choices.values()):
        sp.add_argument("--state-dir", help="state directory (GPUVISOR_STATE_DIR)")
        sp.add_argument("--config", help="TOML config file (GPUVISOR_CONFIG)")
    for sp in (st, pl):
        sp.add_argument("--host", help="the service's address (GPUVISOR_HOST)")
        sp.add_argument("--port", type=int, help="the service's port (GPUVISOR_PORT)")


def check_settings(cfg: Config) -> None:
    """Service settings that msgspec cannot check alone; ConfigError names the key."""
    for name, check in (("trusted_proxies", lambda: proxies.parse_networks(cfg.trusted_proxies)),
                        ("api_keys", lambda: parse_config_keys(cfg.api_keys))):
        try:
            check()
        except ValueError as exc:
            raise ConfigError(f"invalid setting {name}: {exc}") from exc
    if cfg.log_format not in logs.LOG_FORMATS:
        raise ConfigError(f"invalid setting log_format: use one of {', '.join(logs.LOG_FORMATS)}")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def db_has_keys(path: Path) -> bool:
    if not path.exists():
        return False
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        if not conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'api_keys'").fetchone():
            return False  # the migration has not run yet: no keys
        row = conn.execute("SELECT EXISTS(SELECT 1 FROM api_keys WHERE revoked_at IS NULL)").fetchone()
    finally:
        conn.close()
    return bool(row[0])


def exposure_problem(cfg: Config) -> str | None:
    """Why serving as configured would expose an open service, or None."""
    if is_loopback(cfg.host) or cfg.allow_unauthenticated:
        return None
    if cfg.admin_token or cfg.api_keys or db_has_keys(cfg.db_path):
        return None
    return (
        f"refusing to listen on {cfg.host} without authentication: anyone who can reach it could "
        "run models and jobs. Options:\n"
        "  - create an API key: gpuvisor keys add NAME (clients send 'Authorization: Bearer <key>')\n"
        "  - set an admin token: admin_token in the config or GPUVISOR_ADMIN_TOKEN "
        "(gpuvisor keys admin-token makes one)\n"
        "  - keep host = 127.0.0.1 and put nginx or Caddy in front (see systemd/README.md)\n"
        "  - on a network you trust completely: allow_unauthenticated = true")


# ---------------------------------------------------------------- keys


async def _keys(args: argparse.Namespace, cfg: Config) -> int:
    from supervisor.app import MIGRATIONS  # the full schema: the CLI may run first

    cmd = args.keys_command
    if cmd == "admin-token":
        _, token = new_api_key()
        token = "gva_" + token[3:]
        print(token)
        print(f"# config: admin_token = \"{hash_secret(token)}\"  (or GPUVISOR_ADMIN_TOKEN={token})",
              file=sys.stderr)
        return 0
    if cmd == "add" and args.print_config:
        key_id, key = new_api_key()
        print(key)
        print(f"# config: api_keys = [\"{args.name}:{key_id}:{hash_secret(key)}\"]", file=sys.stderr)
        return 0
    db = Database(cfg.db_path, MIGRATIONS)
    await db.open()
    try:
        store = KeyStore(db)
        if cmd == "add":
            was_on = cfg.auth == "on" or bool(cfg.admin_token or cfg.api_keys) or await store.any_ever()
            record, key = await store.add(args.name)
            print(key)
            print(f"# API key {record.name!r} (id {record.id}); shown once, only its hash is stored",
                  file=sys.stderr)
            _advise(key_advice.after_add(record.name, was_on=was_on, service=holder(cfg.state_path),
                                         cfg=cfg, config_url=local_url(cfg.host, cfg.port)))
        elif cmd == "revoke":
            record = await store.revoke(args.name)
            print(f"revoked {record.name} ({record.id})")
            _advise(key_advice.after_revoke(await store.any_active(), cfg))
        else:
            rows = [(r.id, r.name, "database", r.created_at) for r in await store.active()]
            rows += [(r.id, r.name, "config", None) for r in parse_config_keys(cfg.api_keys).values()]
            if not rows:
                print(f"no keys (in {cfg.db_path} or the config); add one with: gpuvisor keys add NAME")
            for key_id, name, source, created in rows:
                when = time.strftime("%Y-%m-%d %H:%M", time.localtime(created)) if created else "-"
                print(f"{key_id}  {name:<24} {source:<8} {when}")
    finally:
        await db.close()
    return 0


def _advise(lines: list[str]) -> None:
    for line in lines:
        print(line, file=sys.stderr)


# ---------------------------------------------------------------- status


def local_url(host: str, port: int) -> str:
    """The service's base URL as seen from this machine (a wildcard bind is reached on loopback)."""
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def service_url(args: argparse.Namespace, cfg: Config) -> str:
    """The running service's URL, from ``--url`` or the host and port settings."""
    return str(args.url or local_url(cfg.host, cfg.port)).rstrip("/")


async def _status(args: argparse.Namespace, cfg: Config) -> int:
    url, cred = service_url(args, cfg), key_advice.credential(args, cfg)
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(headers=cred.headers, timeout=timeout) as http:
        try:
            health = await _get(http, url + "/healthz")
            gpu = await _get(http, url + "/api/gpu")
            jobs = await _get(http, url + "/api/jobs?status=running,queued&limit=20")
        except aiohttp.ClientConnectionError as exc:
            print(pull.unreachable(url, exc), file=sys.stderr)
            return 1
        except aiohttp.ClientResponseError as exc:
            print(f"gpuvisor at {url} refused: {exc.status} {exc.message}", file=sys.stderr)
            _advise(key_advice.refused(exc.status, cred, cfg))
            return 1
        except aiohttp.ClientError as exc:
            print(f"gpuvisor at {url} refused: {exc}", file=sys.stderr)
            return 1
    print(f"gpuvisor at {url}: {health.get('status')}, up {_ago(health.get('uptime_s', 0))}")
    workers = health.get("workers", [])
    print(f"models loaded: {len(workers)}")
    for w in workers:
        line = f"  {w['model']} ({w['mode']}): {w['state']}, queue {w['queued']}+{w['in_flight']}"
        if w.get("restarts"):
            line += f", {w['restarts']} restarts"
        if w.get("reason"):
            line += f" - {w['reason']}"
        print(line)
    for dev in gpu.get("devices", []):
        holder = dev.get("holder")
        held = f"held by job {holder['job_id']} ({holder['label']})" if holder else "free"
        print(f"device {dev['id']} {dev['name']}: {held}")
    if gpu.get("waiters"):
        print(f"jobs waiting for a device: {len(gpu['waiters'])}")
    data = jobs.get("data", [])
    print(f"jobs running or queued: {len(data)}")
    for j in data:
        print(f"  {j['id']} {j['kind']}: {j['status']}")
    return 0


async def _get(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url) as resp:
        body: dict[str, Any] = await resp.json(content_type=None)
        if resp.status >= 400:
            message = body.get("error", {}).get("message", resp.reason)
            raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status, message=message)
        return body


def _ago(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 86400}d {s % 86400 // 3600}h" if s >= 86400 else f"{s // 3600}h {s % 3600 // 60}m {s % 60}s"


# ---------------------------------------------------------------- install


def _install(args: argparse.Namespace) -> int:
    from supervisor.service.systemd import install
    from supervisor.service.unit_devices import detect, device_groups, parse_kinds

    root = Path(args.root)
    exec_path = args.exec_path or shutil.which("gpuvisor") or str(Path(sys.argv[0]).resolve())
    create_user = root == Path("/") and not _user_exists(args.user)
    try:
        chosen = parse_kinds(args.gpu)
    except ValueError as exc:
        print(f"gpuvisor: --gpu: {exc}", file=sys.stderr)
        return 2
    if root == Path("/") and os.geteuid() != 0:
        print("gpuvisor: install-systemd writes to /etc: run it as root (or pass --root DIR)",
              file=sys.stderr)
        return 1
    if chosen is None:
        # The builds of this interpreter's environment: the one --exec runs, as a rule.
        kinds, why = detect()
        print(f"GPU devices: {why}")
    else:
        kinds = chosen
        print(f"GPU devices: {', '.join(kinds) or 'none'} (--gpu)")
    # Only on the real root: a staging root's groups are the target's business.
    groups = [g for g in device_groups(kinds) if _group_exists(g)] if root == Path("/") else []
    for line in install(root, exec_path, args.user, create_user,
                        lambda cmd: subprocess.run(cmd, check=True), kinds, groups):
        print(line)
    if root == Path("/"):
        print("next: systemctl daemon-reload && systemctl enable --now gpuvisor")
    return 0


def _group_exists(name: str) -> bool:
    try:
        grp.getgrnam(name)
    except KeyError:
        return False
    return True


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def run(args: argparse.Namespace, cfg: Config) -> int:
    try:
        if args.command == "keys":
            return asyncio.run(_keys(args, cfg))
        if args.command == "status":
            return asyncio.run(_status(args, cfg))
        if args.command == "pull":
            return asyncio.run(pull.pull(args, cfg, service_url(args, cfg), key_advice.credential(args, cfg)))
        if args.command == "install-systemd":
            return _install(args)
    except ApiError as err:
        print(f"gpuvisor: {err.message}", file=sys.stderr)
        return 1
    return 2
