"""sd_notify against real datagram sockets, the unit file, install-systemd."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from supervisor.service.systemd import Notifier, install, keepalive, render_unit
from supervisor.service.unit_devices import ALL_KINDS, GpuKind, detect, parse_kinds
from tests.server import REPO, Server, short_tempdir


def _parse(datagram: bytes) -> dict[str, str]:
    return dict(line.split("=", 1) for line in datagram.decode().splitlines())


@pytest.fixture
def listener() -> Iterator[tuple[socket.socket, str]]:
    """A notify socket in the abstract namespace, as systemd may hand out."""
    name = f"gv-test-{os.getpid()}-{time.monotonic_ns()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(10)
    yield sock, "@" + name
    sock.close()


def test_notifier_abstract_socket_and_env_removed(listener: tuple[socket.socket, str]) -> None:
    sock, address = listener
    env = {"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "4000000", "WATCHDOG_PID": str(os.getpid())}
    n = Notifier.from_environ(env)
    assert env == {}  # children cannot inherit it
    assert n.watchdog_interval == 2.0
    assert n.ready("up")
    msg = _parse(sock.recv(4096))
    assert msg["READY"] == "1" and msg["STATUS"] == "up" and msg["MAINPID"] == str(os.getpid())
    n.stopping()
    n.extend_timeout(7.5)
    assert _parse(sock.recv(4096))["STOPPING"] == "1"
    assert _parse(sock.recv(4096)) == {"EXTEND_TIMEOUT_USEC": "7500000"}
    n.close()


def test_notifier_outside_systemd_is_a_noop() -> None:
    n = Notifier.from_environ({})
    assert not n.enabled and not n.ready("x") and n.watchdog_interval is None
    other = Notifier.from_environ({"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"})
    assert other.watchdog_interval is None  # meant for another process


async def test_watchdog_only_after_a_healthy_probe(tmp_path: Path) -> None:
    path = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.setblocking(False)
    n = Notifier(str(path), watchdog_usec=100_000)  # ping every 50 ms
    probes: list[bool] = []
    healthy = asyncio.Event()

    async def probe() -> bool:
        probes.append(healthy.is_set())
        return healthy.is_set()

    task = asyncio.create_task(keepalive(n, probe, lambda: "fine", status_every=0.05))
    loop = asyncio.get_running_loop()
    try:
        first = _parse(await asyncio.wait_for(loop.sock_recv(sock, 4096), 5))
        assert first == {"STATUS": "fine"}
        while len(probes) < 3:  # unhealthy probes: no ping may have been sent
            await asyncio.sleep(0.02)
        healthy.set()
        ping = _parse(await asyncio.wait_for(loop.sock_recv(sock, 4096), 5))
        assert ping == {"WATCHDOG": "1"}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        sock.close()
        n.close()


def test_serve_notifies_ready_status_watchdog_stopping(
        tiny_model_path: Path, tmp_path: Path) -> None:
    path = short_tempdir("gvn") / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(20)
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    srv = Server(models, env={"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "1000000"})
    try:
        srv.start(wait_ready=False)
        msgs = [_parse(sock.recv(4096))]
        # READY=1 comes only once the site listens (and the database is open).
        assert msgs[0]["READY"] == "1", msgs
        assert httpx.get(srv.base_url + "/healthz", timeout=5).status_code == 200
        srv.wait_ready()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            msgs.append(_parse(sock.recv(4096)))
            if sum("WATCHDOG" in m for m in msgs) >= 2 and any(
                    "tiny" in m.get("STATUS", "") for m in msgs):
                break
        assert sum("WATCHDOG" in m for m in msgs) >= 2, msgs
        status = [m["STATUS"] for m in msgs if "STATUS" in m][-1]
        assert "models: tiny" in status and "queue: 0" in status and "lease: free" in status
        worker_pid = srv.worker()["pid"]
        env = Path(f"/proc/{worker_pid}/environ").read_bytes().split(b"\0")
        assert not any(e.startswith(b"NOTIFY_SOCKET=") for e in env)
        assert srv.proc is not None
        srv.proc.send_signal(signal.SIGTERM)
        rest: list[dict[str, str]] = []
        while not any("STOPPING" in m for m in rest) or not any("EXTEND_TIMEOUT_USEC" in m for m in rest):
            rest.append(_parse(sock.recv(4096)))
        assert srv.stop() == 0
    finally:
        srv.cleanup()
        sock.close()
        shutil.rmtree(path.parent, ignore_errors=True)
        shutil.rmtree(models, ignore_errors=True)


def test_unit_file_is_the_rendered_one() -> None:
    assert (REPO / "systemd" / "gpuvisor.service").read_text() == render_unit()


@pytest.mark.parametrize("kinds", [ALL_KINDS, ("nvidia",), ("rocm",), ("vulkan",), ("nvidia", "rocm"), ()],
                         ids=lambda k: "+".join(k) or "cpu")
def test_unit_passes_systemd_analyze_verify(tmp_path: Path, kinds: tuple[GpuKind, ...]) -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    # The shipped unit names /opt/gpuvisor/...: verify checks that ExecStart
    # exists, so render it for this interpreter; everything else is identical.
    unit = tmp_path / "gpuvisor.service"
    unit.write_text(render_unit(f"{sys.executable} -m supervisor", "gpuvisor", kinds))
    r = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False)
    if r.returncode != 0 and "Failed to" in r.stderr and "gpuvisor.service" not in r.stderr:
        pytest.skip(f"systemd-analyze cannot run here: {r.stderr.strip()[:300]}")
    assert r.returncode == 0, r.stderr
    assert "Unknown" not in r.stderr and "ignoring" not in r.stderr, r.stderr


def _allowed(unit: str) -> list[str]:
    return [line.removeprefix("DeviceAllow=") for line in unit.splitlines() if line.startswith("DeviceAllow=")]


def test_device_rules_follow_the_gpu_kind() -> None:
    nvidia = ["char-nvidiactl rw", "char-nvidia-frontend rw", "char-nvidia-uvm rw", "char-nvidia-caps rw"]
    assert _allowed(render_unit(kinds=("nvidia",))) == nvidia
    assert _allowed(render_unit(kinds=("rocm",))) == ["/dev/kfd rw", "char-drm rw"]
    # Vulkan runs on any vendor's driver: the DRM nodes, and NVIDIA's for its GPUs.
    assert _allowed(render_unit(kinds=("vulkan",))) == [*nvidia, "char-drm rw"]
    assert _allowed(render_unit(kinds=())) == []
    assert "DevicePolicy=closed" in render_unit(kinds=())
    # The shipped unit, for any build: every kind.
    assert _allowed(render_unit()) == [*nvidia, "/dev/kfd rw", "char-drm rw"]
    assert parse_kinds("auto") is None and parse_kinds("none") == ()
    assert parse_kinds(" ROCm, vulkan,rocm") == ("rocm", "vulkan")
    with pytest.raises(ValueError, match="unknown GPU kind 'cuda'"):
        parse_kinds("cuda")


def _fake_dist(site: Path, name: str, version: str, libs: dict[str, bytes]) -> None:
    """An installed distribution as pip leaves it: dist-info with a RECORD."""
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    record = [f"{info.name}/METADATA,,"]
    for rel, content in libs.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_bytes(content)
        record.append(f"{rel},,")
    (info / "RECORD").write_text("\n".join(record) + "\n")


ELF_CPU = b"\x7fELF" + b"\0" * 64 + b"libgomp.so.1\0libstdc++.so.6\0ggml_backend_cpu_reg\0"


@pytest.mark.parametrize(("engine_lib", "torch_version", "kinds"), [
    (b"libcudart.so.12\0libcublas.so.12\0", "2.13.0+cu128", ("nvidia",)),
    (b"libamdhip64.so.6\0libhipblas.so.2\0", "2.13.0+rocm6.4", ("rocm",)),
    (b"libvulkan.so.1\0", "2.13.0+cpu", ("vulkan",)),
    (b"libamdhip64-8c2d1f0e.so.6\0", None, ("rocm",)),  # bundled by auditwheel, no torch
    (b"", "2.13.0+rocm6.4", ("rocm",)),  # a CPU engine beside a ROCm torch (vLLM, fine-tunes)
])
def test_the_installed_builds_choose_the_kinds(tmp_path: Path, engine_lib: bytes,
                                               torch_version: str | None, kinds: tuple[GpuKind, ...]) -> None:
    _fake_dist(tmp_path, "xllamacpp", "2026.10.11549", {
        "xllamacpp/xllamacpp.abi3.so": ELF_CPU,
        "xllamacpp/__init__.py": b"",
        **({"xllamacpp.libs/libggml-gpu.so.0": ELF_CPU + engine_lib} if engine_lib else {})})
    if torch_version is not None:
        _fake_dist(tmp_path, "torch", torch_version, {"torch/__init__.py": b""})
    found, why = detect([str(tmp_path)])
    assert found == kinds, why
    assert "the unit allows" in why


def test_cpu_builds_allow_every_kind_and_say_so(tmp_path: Path) -> None:
    _fake_dist(tmp_path, "xllamacpp", "1.0", {"xllamacpp/xllamacpp.abi3.so": ELF_CPU})
    _fake_dist(tmp_path, "torch", "2.13.0+cpu", {})
    found, why = detect([str(tmp_path)])
    assert found == ALL_KINDS
    assert "engine: CPU build; torch: CPU build" in why and "--gpu" in why
    assert detect([str(tmp_path / "empty")])[1].startswith("engine: not installed; torch: not installed")


def test_install_for_rocm_adds_the_render_group(tmp_path: Path) -> None:
    calls: list[list[str]] = []
    done = install(tmp_path, "/usr/bin/gpuvisor", "gpuvisor", create_user=True, run=calls.append,
                   kinds=("rocm",), groups=["render", "video"])
    assert calls[1] == ["usermod", "--append", "--groups", "render,video", "gpuvisor"]
    assert any("render, video" in line for line in done)
    unit = (tmp_path / "etc/systemd/system/gpuvisor.service").read_text()
    assert _allowed(unit) == ["/dev/kfd rw", "char-drm rw"] and "(rocm) allowed" in unit


def test_install_writes_unit_and_keeps_local_config(tmp_path: Path) -> None:
    calls: list[list[str]] = []
    run: Callable[[list[str]], None] = calls.append
    done = install(tmp_path, "/usr/bin/gpuvisor", "gpuvisor", create_user=False, run=run)
    unit = tmp_path / "etc/systemd/system/gpuvisor.service"
    assert "ExecStart=/usr/bin/gpuvisor serve" in unit.read_text()
    env = tmp_path / "etc/gpuvisor/gpuvisor.env"
    assert env.stat().st_mode & 0o777 == 0o640
    (tmp_path / "etc/gpuvisor/config.toml").write_text('port = 9000\n')
    again = install(tmp_path, "/usr/bin/gpuvisor", "gpuvisor", create_user=True, run=run)
    assert (tmp_path / "etc/gpuvisor/config.toml").read_text() == 'port = 9000\n'
    assert any(line.startswith("kept") for line in again) and len(done) == 3
    assert calls and calls[0][0] == "useradd"


def test_install_systemd_cli_under_a_root(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "supervisor", "install-systemd", "--root", str(tmp_path),
                        "--exec", "/usr/local/bin/gpuvisor", "--state-dir", str(tmp_path / "state")],
                       capture_output=True, text=True, cwd=REPO, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "etc/systemd/system/gpuvisor.service").exists()
    assert r.stdout.startswith("GPU devices: engine: ")  # detected, and why
    # Groups belong to the target machine: a staging root adds none.
    assert "usermod" not in r.stdout and "groups" not in r.stdout


def test_install_systemd_cli_gpu_choice(tmp_path: Path) -> None:
    def cli(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "supervisor", "install-systemd", "--root", str(tmp_path),
                               "--exec", "/usr/local/bin/gpuvisor", "--state-dir", str(tmp_path / "state"),
                               *extra], capture_output=True, text=True, cwd=REPO, timeout=60, check=False)

    r = cli("--gpu", "rocm")
    assert r.returncode == 0, r.stderr
    assert "GPU devices: rocm (--gpu)" in r.stdout
    unit = (tmp_path / "etc/systemd/system/gpuvisor.service").read_text()
    assert _allowed(unit) == ["/dev/kfd rw", "char-drm rw"]
    bad = cli("--gpu", "cuda")
    assert bad.returncode == 2 and "unknown GPU kind 'cuda'" in bad.stderr
    # A refused choice leaves the unit as it was.
    assert (tmp_path / "etc/systemd/system/gpuvisor.service").read_text() == unit
