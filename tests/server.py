"""A real gpuvisor parent process for tests (started with ``python -m supervisor``)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx

REPO = Path(__file__).resolve().parent.parent
_LISTEN = re.compile(r"gpuvisor listening on http://[^:]+:(\d+)")

# Quick liveness and restart settings so failure paths are fast to test.
FAST_ENV = {
    "GPUVISOR_PING_INTERVAL": "0.5",
    "GPUVISOR_PING_TIMEOUT": "5",
    "GPUVISOR_KILL_GRACE": "2",
    "GPUVISOR_RESTART_BACKOFF_MIN": "0.2",
    "GPUVISOR_RESTART_BACKOFF_MAX": "1",
    "GPUVISOR_N_CTX": "1024",
    "GPUVISOR_N_THREADS": "1",
    "GPUVISOR_WRITE_DEMO_MODEL": "false",
    "GPUVISOR_SHUTDOWN_TIMEOUT": "5",
    # The sleep job kind, which many tests run.
    "GPUVISOR_TEST_JOB_KINDS": "1",
}

# Where huggingface_hub finds its cache (a test's own values replace them all).
HUB_CACHE_ENV = frozenset({"HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"})

T = TypeVar("T")


def poll_until(get: Callable[[], T], pred: Callable[[T], bool], timeout: float = 20,
               interval: float = 0.1) -> T:
    """Read ``get()`` until ``pred`` holds, and return that value. Another
    process's state over HTTP has no event to await: this bounded poll is
    the wait; the bound is coarse, against hangs only."""
    deadline = time.monotonic() + timeout
    while not pred(value := get()):
        assert time.monotonic() < deadline, f"never held; last: {value!r}"
        time.sleep(interval)
    return value


def short_tempdir(prefix: str = "gv") -> Path:
    # Unix socket paths live under the state dir and are limited to ~108 bytes.
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


class Server:
    def __init__(self, models_dir: Path, state_dir: Path | None = None,
                 env: dict[str, str] | None = None, args: list[str] | None = None,
                 model: str | None = None) -> None:
        self.models_dir = models_dir
        self.state_dir = state_dir or short_tempdir()
        self.extra_env = env or {}
        self.args = args or []
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.state_dir / "server.log"
        ids = sorted(p.name[:-5] for p in models_dir.glob("*.gguf"))
        self.model = model or (ids[0] if ids else "")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUVISOR_") and k not in HUB_CACHE_ENV}
        env.update(FAST_ENV)
        if not HUB_CACHE_ENV & self.extra_env.keys():
            # The service lists the Hub cache by default: this server's own, never the user's.
            env["HF_HOME"] = str(self.state_dir / "hf-home")
        env.update(self.extra_env)
        env["PYTHONPATH"] = str(REPO)
        return env

    def start(self, wait_ready: bool = True) -> Server:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        offset = self.log_path.stat().st_size
        cmd = [sys.executable, "-m", "supervisor", "serve", "--host", "127.0.0.1",
               "--port", str(self.port), "--state-dir", str(self.state_dir),
               "--models-dir", str(self.models_dir), *self.args]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env(),
                                     cwd=REPO, stdin=subprocess.DEVNULL)
        log.close()
        self.port = self._wait_port(offset)
        if wait_ready and self.model:
            self.wait_ready()
        return self

    def _wait_port(self, offset: int, timeout: float = 180) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log_path.read_bytes()[offset:].decode(errors="replace")
            found = _LISTEN.search(text)
            if found:
                return int(found.group(1))
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{text}")
            time.sleep(0.05)
        raise TimeoutError(f"server did not start:\n{self.log_text()}")

    def wait_ready(self, timeout: float = 180) -> None:
        # A coarse bound against a hang: a preloaded vLLM worker alone took
        # over 60 s to be ready on a busy two-core machine.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.base_url + "/readyz", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet: try again
            time.sleep(0.05)
        raise TimeoutError(f"server not ready:\n{self.log_text()}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def workers(self) -> list[dict[str, Any]]:
        workers: list[dict[str, Any]] = httpx.get(self.base_url + "/api/workers", timeout=10).json()["workers"]
        return workers

    def worker(self, model: str | None = None) -> dict[str, Any]:
        model = model or self.model
        for w in self.workers():
            if w["model"] == model and w["mode"] == "generate":
                return w
        raise KeyError(model)

    def wait_worker(self, pred: Any, model: str | None = None, timeout: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                w = self.worker(model)
                if pred(w):
                    return w
            except KeyError:
                pass  # not started yet
            time.sleep(0.05)
        raise TimeoutError(f"worker never matched; last: {self.workers()}")

    def kill_worker(self, model: str | None = None) -> int:
        pid = int(self.wait_worker(lambda w: w["state"] == "ready", model)["pid"])
        os.kill(pid, signal.SIGKILL)
        return pid

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        code = self.proc.returncode
        self.proc = None
        return code

    def restart(self) -> Server:
        self.stop()
        return self.start()

    def cleanup(self) -> None:
        self.stop(signal.SIGKILL if self.proc is not None and self.proc.poll() is None else signal.SIGTERM)
        shutil.rmtree(self.state_dir, ignore_errors=True)


@contextmanager
def running(srv: Server) -> Iterator[Server]:
    """``srv`` started, then stopped and its state removed, even when the
    start itself fails (a server that never became ready is not left behind)."""
    try:
        yield srv.start()
    finally:
        srv.cleanup()
