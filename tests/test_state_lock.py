"""One parent per state dir: a second ``gpuvisor serve`` on it refuses to start."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil

from supervisor.service.state_lock import LOCK_NAME, PROBE_PAUSE_S, StateLock, holder
from tests.server import REPO, Server, poll_until, short_tempdir


def _serve(state_dir: Path, models_dir: Path) -> subprocess.CompletedProcess[str]:
    """A second ``gpuvisor serve`` on ``state_dir`` (its own port), run to its end."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUVISOR_")}
    env.update(PYTHONPATH=str(REPO), GPUVISOR_WRITE_DEMO_MODEL="false")
    return subprocess.run(
        [sys.executable, "-m", "supervisor", "serve", "--host", "127.0.0.1", "--port", "0",
         "--state-dir", str(state_dir), "--models-dir", str(models_dir)],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=60, check=False)


def test_a_second_serve_on_the_same_state_dir_names_the_first(start_server: Callable[..., Server]) -> None:
    first = start_server(short_tempdir("gvm"))
    assert first.proc is not None
    second = _serve(first.state_dir, short_tempdir("gvm"))
    assert second.returncode != 0
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1, second.stderr
    assert f"pid {first.proc.pid}" in lines[0] and str(first.state_dir) in lines[0], lines[0]
    assert "gpuvisor listening" not in second.stdout
    # The first one never noticed: it still serves, and is the one the CLI finds.
    assert httpx.get(first.base_url + "/healthz", timeout=10).status_code == 200
    found = holder(first.state_dir)
    assert found is not None and found.pid == first.proc.pid and found.url == first.base_url


def test_the_lock_ends_with_its_process_even_a_killed_one(start_server: Callable[..., Server]) -> None:
    srv = start_server(short_tempdir("gvm"))
    assert srv.proc is not None
    assert srv.stop(signal.SIGKILL) is not None  # no cleanup ran: the lock file stays
    assert (srv.state_dir / LOCK_NAME).exists()
    # A child the parent was starting when it was killed (forked, not yet
    # exec'd) shares the lock until its exec closes the descriptor: an instant,
    # longer on a loaded machine.
    poll_until(lambda: holder(srv.state_dir), lambda found: found is None, timeout=30)
    srv.start()  # the same state dir again
    assert srv.proc is not None
    found = holder(srv.state_dir)
    assert found is not None and found.pid == srv.proc.pid
    assert srv.stop(signal.SIGTERM) == 0
    assert holder(srv.state_dir) is None


def test_children_do_not_inherit_the_lock(server: Server) -> None:
    # A worker that outlived its parent for a moment must not hold the state
    # dir against the next start.
    pid = int(server.wait_worker(lambda w: w["state"] == "ready")["pid"])
    lock = str(server.state_dir / LOCK_NAME)
    assert lock not in {f.path for f in psutil.Process(pid).open_files()}
    assert server.proc is not None
    assert lock in {f.path for f in psutil.Process(server.proc.pid).open_files()}


def test_a_start_that_meets_a_cli_probe_waits_it_out(tmp_path: Path) -> None:
    # `gpuvisor keys add` probes the lock with a shared flock for an instant;
    # a service starting at that instant must not take the probe for a service.
    (tmp_path / LOCK_NAME).write_text("999999999\n")  # a pid left by a service long gone
    probe = os.open(tmp_path / LOCK_NAME, os.O_RDONLY)
    fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
    pauses: list[float] = []

    def probe_ends(seconds: float) -> None:
        pauses.append(seconds)
        os.close(probe)  # the probe is done: its shared lock goes with the fd

    with StateLock(tmp_path, pause=probe_ends):
        assert pauses == [PROBE_PAUSE_S]
        found = holder(tmp_path)
        assert found is not None and found.pid == os.getpid() and found.url is None
    assert holder(tmp_path) is None
