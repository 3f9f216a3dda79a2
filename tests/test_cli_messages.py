"""What the CLI tells a user about authentication, run as the real commands
against a real service: ``keys add`` says auth is now on and how to get in,
``status`` refused with 401 says how to pass a token, ``keys revoke`` of the
last key says how ``auth = "off"`` undoes it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.server import REPO, Server, poll_until, short_tempdir


def gpuvisor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GPUVISOR_")}
    return subprocess.run([sys.executable, "-m", "supervisor", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=60, check=False,
                          env={**clean, "PYTHONPATH": str(REPO), **(env or {})})


def _status(srv: Server, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return gpuvisor("status", "--url", srv.base_url, "--state-dir", str(srv.state_dir), *args, env=env)


def test_the_first_key_says_auth_is_on_and_how_to_get_in(start_server: Callable[..., Server]) -> None:
    srv = start_server(short_tempdir("gvm"))
    assert srv.proc is not None
    assert httpx.get(srv.base_url + "/v1/models", timeout=10).status_code == 200  # open: no keys yet
    added = gpuvisor("keys", "add", "ci-bot", "--state-dir", str(srv.state_dir))
    assert added.returncode == 0, added.stderr
    key = added.stdout.strip()
    assert key.startswith("gv_") and "\n" not in key  # stdout is the key alone, for scripts
    said = added.stderr
    assert (f"Authentication is now ON for the gpuvisor running on this state dir (pid {srv.proc.pid}, "
            f"{srv.base_url})") in said
    assert "Authorization: Bearer <key>" in said
    assert "gpuvisor keys admin-token" in said and f"sign in at {srv.base_url}/login" in said
    assert "gpuvisor keys revoke ci-bot" in said and 'auth = "off"' in said
    # And it is true: the service refuses what it served a moment ago.
    poll_until(lambda: httpx.get(srv.base_url + "/v1/models", timeout=10).status_code, lambda s: s == 401)
    assert httpx.get(srv.base_url + "/v1/models", timeout=10,
                     headers={"Authorization": f"Bearer {key}"}).status_code == 200

    second = gpuvisor("keys", "add", "lab", "--state-dir", str(srv.state_dir))
    assert second.returncode == 0 and "Authentication was already on." in second.stderr

    denied = _status(srv)
    assert denied.returncode == 1
    assert "refused: 401" in denied.stderr
    assert "authentication is on and no token was sent" in denied.stderr
    assert "--token TOKEN or GPUVISOR_TOKEN=TOKEN" in denied.stderr
    wrong = _status(srv, "--token", key + "x")
    assert wrong.returncode == 1 and "the token from --token was not accepted" in wrong.stderr
    for args, env in (((), {"GPUVISOR_TOKEN": key}), (("--token", key), None)):
        ok = _status(srv, *args, env=env)
        assert ok.returncode == 0, ok.stderr
        assert "models loaded: 0" in ok.stdout


def test_revoking_the_last_key_says_how_auth_off_undoes_it(start_server: Callable[..., Server]) -> None:
    srv = start_server(short_tempdir("gvm"))
    state = ("--state-dir", str(srv.state_dir))
    assert gpuvisor("keys", "add", "a", *state).returncode == 0
    assert gpuvisor("keys", "add", "b", *state).returncode == 0
    first = gpuvisor("keys", "revoke", "a", *state)
    assert first.returncode == 0 and first.stdout.startswith("revoked a")
    assert "last key" not in first.stderr  # b is left
    last = gpuvisor("keys", "revoke", "b", *state)
    assert last.returncode == 0
    assert "That was the last key: authentication stays on" in last.stderr
    assert 'auth = "off"' in last.stderr and "GPUVISOR_AUTH=off" in last.stderr
    poll_until(lambda: httpx.get(srv.base_url + "/v1/models", timeout=10).status_code, lambda s: s == 401)
    # What it says works: the same state dir with auth = "off" serves openly again.
    srv.stop()
    srv.extra_env["GPUVISOR_AUTH"] = "off"
    srv.start()
    assert httpx.get(srv.base_url + "/v1/models", timeout=10).status_code == 200


def test_a_key_added_while_no_service_runs_says_when_it_applies(tmp_path: Path) -> None:
    state = short_tempdir("gvs")
    added = gpuvisor("keys", "add", "offline", "--state-dir", str(state))
    assert added.returncode == 0, added.stderr
    assert "Authentication is on from the next start of gpuvisor on this state dir" in added.stderr
    config = tmp_path / "off.toml"
    config.write_text('auth = "off"\n')
    off = gpuvisor("keys", "add", "later", "--state-dir", str(state), "--config", str(config))
    assert off.returncode == 0
    assert 'auth = "off" is set: the service checks no key' in off.stderr
