"""systemd integration without a dependency: sd_notify, the watchdog, the unit.

The notify protocol is one datagram of ``KEY=VALUE`` lines sent to the
``AF_UNIX`` socket named by ``NOTIFY_SOCKET`` (a leading ``@`` names an
abstract socket). ``WATCHDOG=1`` is sent only from a task on the main event
loop after a health probe succeeded, so a wedged loop or a stuck database
stops the pings and systemd restarts the service.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

from supervisor.appkeys import DB, LEASE, POOL
from supervisor.service.unit_devices import ALL_KINDS, GpuKind, device_rules

log = logging.getLogger("gpuvisor.systemd")

_NOTIFY_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def _address(raw: str) -> str | None:
    if raw.startswith("@"):
        return "\0" + raw[1:]  # abstract namespace
    if raw.startswith("/"):
        return raw
    return None  # vsock and other families are not supported here


class Notifier:
    """Sends sd_notify messages; every method is a no-op outside systemd."""

    def __init__(self, address: str | None, watchdog_usec: int = 0) -> None:
        self.address = address
        self.watchdog_usec = watchdog_usec
        self._sock: socket.socket | None = None
        if address is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.setblocking(False)

    @classmethod
    def from_environ(cls, environ: MutableMapping[str, str], unset: bool = True) -> Notifier:
        """Read NOTIFY_SOCKET / WATCHDOG_*; with ``unset``, remove them so no
        child (worker, job) can talk to systemd in our name."""
        raw = environ.get("NOTIFY_SOCKET", "")
        usec = environ.get("WATCHDOG_USEC", "")
        pid = environ.get("WATCHDOG_PID", "")
        if unset:
            for name in _NOTIFY_VARS:
                environ.pop(name, None)
        address = _address(raw) if raw else None
        if raw and address is None:
            log.warning("NOTIFY_SOCKET %r is not a unix socket path; notifications disabled", raw)
        watchdog = int(usec) if usec.isdigit() else 0
        if pid and pid.isdigit() and int(pid) != os.getpid():
            watchdog = 0  # the watchdog is meant for another process
        return cls(address, watchdog)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between pings: half the watchdog timeout, as systemd advises."""
        return self.watchdog_usec / 2e6 if self.watchdog_usec > 0 else None

    def send(self, **fields: str | int) -> bool:
        if self._sock is None or self.address is None:
            return False
        payload = "\n".join(f"{k}={v}" for k, v in fields.items()).encode()
        try:
            self._sock.sendto(payload, self.address)
        except OSError as exc:
            # systemd gone or the socket full: the service itself must go on.
            log.warning("sd_notify failed: %s", exc)
            return False
        return True

    def ready(self, status: str) -> bool:
        return self.send(READY=1, STATUS=status, MAINPID=os.getpid())

    def status(self, text: str) -> bool:
        return self.send(STATUS=text)

    def watchdog(self) -> bool:
        return self.send(WATCHDOG=1)

    def stopping(self, status: str = "stopping") -> bool:
        return self.send(STOPPING=1, STATUS=status)

    def extend_timeout(self, seconds: float) -> bool:
        return self.send(EXTEND_TIMEOUT_USEC=int(seconds * 1e6))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def service_status(app: web.Application) -> str:
    """One line for ``STATUS=``: loaded models, queue depth, lease holder."""

    parts: list[str] = []
    pool = app.get(POOL)
    if pool is not None:
        workers = pool.workers()
        ready = sorted(w["model"] for w in workers if w["state"] == "ready")
        queued = sum(int(w["queued"]) + int(w["in_flight"]) for w in workers)
        parts.append(f"models: {', '.join(ready) if ready else 'none loaded'}")
        parts.append(f"queue: {queued}")
    lease = app.get(LEASE)
    if lease is not None:
        holders = [f"{d['id']}={d['holder']['job_id']}" for d in lease.snapshot()["devices"]
                   if d["holder"] is not None]
        parts.append(f"lease: {', '.join(holders) if holders else 'free'}")
    return "; ".join(parts) or "starting"


async def healthy(app: web.Application, timeout: float) -> bool:
    """True when the loop is responsive and the database answers in time."""
    db = app.get(DB)
    if db is None:
        return False
    try:
        async with asyncio.timeout(timeout):
            async with db.conn.execute("SELECT 1") as cur:
                await cur.fetchone()
    except (TimeoutError, RuntimeError) as exc:
        log.error("health probe failed, withholding WATCHDOG=1: %s", exc or "timeout")
        return False
    return True


async def keepalive(notifier: Notifier, probe: Callable[[], Awaitable[bool]],
                    status: Callable[[], str], status_every: float = 5.0) -> None:
    """Runs until cancelled: WATCHDOG=1 after each good probe, STATUS= on change."""
    interval = notifier.watchdog_interval
    tick = min(interval, status_every) if interval else status_every
    loop = asyncio.get_running_loop()
    last_status = ""
    last_ping = 0.0
    while True:
        now = loop.time()
        if interval and now - last_ping >= interval * 0.9 and await probe():
            notifier.watchdog()
            last_ping = now
        text = status()
        if text != last_status:
            notifier.status(text)
            last_status = text
        await asyncio.sleep(tick)


async def extend_while(notifier: Notifier, bound_s: float, step_s: float = 5.0) -> None:
    """While draining, keep systemd's stop timeout ahead of our own bound;
    past the bound stop extending, so a stuck shutdown is still killed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound_s
    while (left := deadline - loop.time()) > 0:
        notifier.extend_timeout(left + step_s)
        await asyncio.sleep(min(step_s, left))


# ---------------------------------------------------------------- the unit

UNIT_TEMPLATE = """\
# gpuvisor.service: written by `gpuvisor install-systemd`.
# Do not edit this file: upgrades rewrite it. Put local changes in a drop-in
# (`systemctl edit gpuvisor`), settings in /etc/gpuvisor/config.toml and
# secrets in /etc/gpuvisor/gpuvisor.env.

[Unit]
Description=gpuvisor: a GPU workstation as a small AI lab
After=network-online.target nvidia-persistenced.service
Wants=network-online.target

[Service]
Type=notify
NotifyAccess=main
ExecStart={exec_start} serve --config /etc/gpuvisor/config.toml
# SIGHUP: scan the models dirs again (`systemctl reload gpuvisor`).
ExecReload=/bin/kill -HUP $MAINPID
EnvironmentFile=-/etc/gpuvisor/gpuvisor.env
# HF_HOME: the Hugging Face cache that `gpuvisor pull` fills and the library
# lists lives in the state dir, owned by the service user.
Environment=PYTHONUNBUFFERED=1 HOME=/var/lib/gpuvisor HF_HOME=/var/lib/gpuvisor/huggingface
User={user}
Group={user}
StateDirectory=gpuvisor
StateDirectoryMode=0750
ConfigurationDirectory=gpuvisor
WorkingDirectory=/var/lib/gpuvisor
UMask=0027

# Startup opens the database, recovers jobs and listens before READY=1.
TimeoutStartSec=300
WatchdogSec=30
Restart=on-failure
RestartSec=5
# SIGTERM to gpuvisor only; it drains streams, asks jobs to checkpoint and
# stops its workers by process group. Anything left is SIGKILLed after
# TimeoutStopSec, longer than the longest job grace period; gpuvisor extends
# it (EXTEND_TIMEOUT_USEC) while it is still draining.
KillMode=mixed
KillSignal=SIGTERM
TimeoutStopSec=180

# Hardening that keeps the GPU working: no PrivateDevices, no
# MemoryDenyWriteExecute (CUDA, ROCm and llama.cpp JIT), and only the GPU
# device nodes of the engine build ({gpu_kinds}) allowed.
NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome=yes
PrivateTmp=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
RestrictSUIDSGID=yes
RestrictRealtime=yes
RestrictNamespaces=yes
LockPersonality=yes
CapabilityBoundingSet=
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK
DevicePolicy=closed
{device_allow}LimitNOFILE=65536

[Install]
WantedBy=multi-user.target
"""

DEFAULT_EXEC = "/opt/gpuvisor/venv/bin/gpuvisor"


def render_unit(exec_start: str = DEFAULT_EXEC, user: str = "gpuvisor",
                kinds: Sequence[GpuKind] = ALL_KINDS) -> str:
    """The unit; ``kinds`` choose its GPU device rules (the shipped file allows all)."""
    allow = "".join(f"DeviceAllow={rule}\n" for rule in device_rules(kinds))
    return UNIT_TEMPLATE.format(exec_start=exec_start, user=user, device_allow=allow,
                                gpu_kinds=", ".join(kinds) or "none: CPU only")


CONFIG_TEMPLATE = """\
# gpuvisor settings; every key can also be set as GPUVISOR_<KEY> in
# /etc/gpuvisor/gpuvisor.env (secrets belong there, mode 0640).
# The CLI (gpuvisor keys, status) finds the service's state through this.
state_dir = "/var/lib/gpuvisor"
host = "127.0.0.1"
port = 8470
# models_dir = "/srv/models"
# trusted_proxies = ["127.0.0.1", "::1"]
# log_format = "json"
"""

ENV_TEMPLATE = """\
# Secrets for gpuvisor.service (root:gpuvisor, mode 0640).
# GPUVISOR_ADMIN_TOKEN=
# GPUVISOR_HF_TOKEN=
"""


def install_plan(root: Path, exec_start: str, user: str,
                 kinds: Sequence[GpuKind] = ALL_KINDS) -> list[tuple[Path, str, int, bool]]:
    """(path, content, mode, overwrite) for each file; config is never overwritten."""
    return [
        (root / "etc/systemd/system/gpuvisor.service", render_unit(exec_start, user, kinds), 0o644, True),
        (root / "etc/gpuvisor/config.toml", CONFIG_TEMPLATE, 0o644, False),
        (root / "etc/gpuvisor/gpuvisor.env", ENV_TEMPLATE, 0o640, False),
    ]


def install(root: Path, exec_start: str, user: str, create_user: bool,
            run: Callable[[list[str]], Any], kinds: Sequence[GpuKind] = ALL_KINDS,
            groups: Sequence[str] = ()) -> list[str]:
    """Write the unit and config skeleton; returns what was done, line by line.

    ``groups`` (those of :func:`device_groups` that exist here) are added to
    the user: DRM and KFD nodes are usually group ``render``/``video``, 0660.
    """
    done: list[str] = []
    if create_user:
        run(["useradd", "--system", "--user-group", "--home-dir", "/var/lib/gpuvisor",
             "--no-create-home", "--shell", "/usr/sbin/nologin", user])
        done.append(f"created system user {user}")
    if groups:
        run(["usermod", "--append", "--groups", ",".join(groups), user])
        done.append(f"added {user} to the groups {', '.join(groups)} (GPU device nodes)")
    for path, content, mode, overwrite in install_plan(root, exec_start, user, kinds):
        if path.exists() and not overwrite:
            done.append(f"kept {path}")
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        path.chmod(mode)
        done.append(f"wrote {path}")
    return done
