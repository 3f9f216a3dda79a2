"""API keys, admin token, CSRF, security headers, the exposure check."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from supervisor.api.auth import (
    Auth,
    Principal,
    hash_secret,
    key_id_of,
    new_api_key,
    parse_config_keys,
    verify_secret,
)
from tests.server import REPO, Server, running, short_tempdir

ADMIN = "admin-token-for-tests-0123456789"


def gpuvisor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "supervisor", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=60, check=False)


@pytest.fixture(scope="module")
def secured() -> Iterator[Server]:
    # No model: these tests never generate, so no worker is started.
    with running(Server(short_tempdir("gvm"), env={"GPUVISOR_ADMIN_TOKEN": ADMIN})) as srv:
        yield srv


@pytest.fixture(scope="module")
def user_key(secured: Server) -> str:
    r = gpuvisor("keys", "add", "ci-bot", "--state-dir", str(secured.state_dir))
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_hashes_are_salted_and_verified() -> None:
    a, b = hash_secret("s3cret"), hash_secret("s3cret")
    assert a != b and a.startswith("scrypt$")
    assert verify_secret("s3cret", a) and not verify_secret("s3creT", a)
    assert not verify_secret("s3cret", "plain") and key_id_of("gv_0123abcd_xyz") == "0123abcd"
    with pytest.raises(ValueError):
        parse_config_keys(["no-hash-here"])


def test_v1_needs_a_key(secured: Server, user_key: str) -> None:
    url = secured.base_url
    r = httpx.get(url + "/v1/models")
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"
    assert r.headers["WWW-Authenticate"].startswith("Bearer")
    wrong = user_key[:-4] + "AAAA"
    assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {wrong}"}).status_code == 401
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer gv_zz"}).status_code == 401
    for token in (user_key, ADMIN):
        ok = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {token}"})
        assert ok.status_code == 200, ok.text
    assert httpx.get(url + "/healthz").status_code == 200
    assert httpx.get(url + "/readyz").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 401
    # The API description: any key, not only the admin token.
    assert httpx.get(url + "/openapi.json").status_code == 401
    spec = httpx.get(url + "/openapi.json", headers={"Authorization": f"Bearer {user_key}"})
    assert spec.status_code == 200 and spec.json()["openapi"].startswith("3.1")


def test_api_mutations_need_the_admin_token(secured: Server, user_key: str) -> None:
    url = secured.base_url
    user = {"Authorization": f"Bearer {user_key}"}
    admin = {"Authorization": f"Bearer {ADMIN}"}
    assert httpx.get(url + "/api/jobs", headers=user).status_code == 200
    r = httpx.post(url + "/api/jobs/nope/cancel", headers=user)
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    assert httpx.post(url + "/api/jobs/nope/cancel", headers=admin).status_code == 404


def test_revoked_key_stops_working(secured: Server) -> None:
    key = gpuvisor("keys", "add", "temp", "--state-dir", str(secured.state_dir)).stdout.strip()
    headers = {"Authorization": f"Bearer {key}"}
    assert httpx.get(secured.base_url + "/v1/models", headers=headers).status_code == 200
    listed = gpuvisor("keys", "list", "--state-dir", str(secured.state_dir)).stdout
    assert "temp" in listed and key not in listed
    r = gpuvisor("keys", "revoke", "temp", "--state-dir", str(secured.state_dir))
    assert r.returncode == 0, r.stderr
    assert httpx.get(secured.base_url + "/v1/models", headers=headers).status_code == 401


def test_ui_login_cookie_and_csrf(secured: Server) -> None:
    url = secured.base_url
    r = httpx.get(url + "/", headers={"Accept": "text/html"})
    assert r.status_code == 303 and r.headers["Location"] == "login"
    assert "<form" in httpx.get(url + "/login").text
    bad = httpx.post(url + "/login", data={"token": "wrong"})
    assert bad.status_code == 401
    login = httpx.post(url + "/login", data={"token": ADMIN}, headers={"Origin": url})
    assert login.status_code == 303
    cookie = login.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
    jar = dict(login.cookies)
    assert httpx.get(url + "/", cookies=jar).status_code == 200
    # Cookie-authenticated changes must come from our own origin.
    evil = httpx.post(url + "/api/jobs/nope/cancel", cookies=jar, headers={"Origin": "https://evil.example"})
    assert evil.status_code == 403 and evil.json()["error"]["code"] == "csrf_origin"
    same = httpx.post(url + "/api/jobs/nope/cancel", cookies=jar, headers={"Origin": url})
    assert same.status_code == 404
    cross = httpx.post(url + "/api/jobs/nope/cancel", cookies=jar, headers={"Sec-Fetch-Site": "cross-site"})
    assert cross.status_code == 403


def test_security_headers_and_request_id(secured: Server) -> None:
    r = httpx.get(secured.base_url + "/healthz", headers={"X-Request-Id": "trace-42"})
    assert r.headers["X-Content-Type-Options"] == "nosniff"
    assert r.headers["Referrer-Policy"] == "same-origin"
    assert "script-src 'self'" in r.headers["Content-Security-Policy"]
    assert "unsafe-inline" not in r.headers["Content-Security-Policy"]
    assert r.headers["X-Request-Id"] == "trace-42"
    forged = httpx.get(secured.base_url + "/healthz", headers={"X-Request-Id": "a b=c \"q\"" + "x" * 200})
    assert forged.headers["X-Request-Id"].startswith("req_")


def test_secrets_never_logged(secured: Server, user_key: str) -> None:
    httpx.get(secured.base_url + "/v1/models", headers={"Authorization": f"Bearer {user_key}x"})
    # Not a polled route: a successful /healthz read is logged at DEBUG only.
    httpx.get(secured.base_url + "/v1/models", headers={"X-Request-Id": "find-me-1"})
    deadline = time.monotonic() + 5
    while "find-me-1" not in secured.log_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    text = secured.log_text()
    assert "find-me-1" in text  # the access log carries the request id
    assert ADMIN not in text and user_key not in text


def test_non_loopback_bind_needs_auth(start_server: Callable[..., Server]) -> None:
    with pytest.raises(RuntimeError, match="refusing to listen on 0.0.0.0"):
        start_server(short_tempdir("gvm"), args=["--host", "0.0.0.0"])
    srv = start_server(short_tempdir("gvm"), args=["--host", "0.0.0.0"],
                       env={"GPUVISOR_ADMIN_TOKEN": ADMIN})
    assert httpx.get(srv.base_url + "/healthz").status_code == 200
    # A key in the database counts as authentication too.
    keyed = Server(short_tempdir("gvm"), args=["--host", "0.0.0.0"])
    try:
        assert gpuvisor("keys", "add", "k", "--state-dir", str(keyed.state_dir)).returncode == 0
        keyed.start()
        assert httpx.get(keyed.base_url + "/v1/models").status_code == 401
    finally:
        keyed.cleanup()


def test_status_command(secured: Server, tmp_path: Path) -> None:
    r = gpuvisor("status", "--url", secured.base_url, "--token", ADMIN, "--state-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "models loaded: 0" in r.stdout and "device cpu" in r.stdout
    denied = gpuvisor("status", "--url", secured.base_url, "--state-dir", str(tmp_path))
    assert denied.returncode == 1 and "401" in denied.stderr


async def test_config_keys_and_hashed_admin_token() -> None:
    key_id, key = new_api_key()
    admin = "gva_" + new_api_key()[1][3:]  # as `gpuvisor keys admin-token` makes it
    gate = Auth(None, parse_config_keys([f"lab:{key_id}:{hash_secret(key)}"]), hash_secret(admin))
    assert await gate.enabled()
    assert await gate.identify_bearer(key) == Principal("lab", "user")
    assert await gate.identify_bearer(key) == Principal("lab", "user")  # cached path
    assert await gate.identify_bearer(admin) == Principal("admin", "admin")
    assert await gate.identify_bearer(key + "x") is None
    assert await gate.identify_bearer(admin + "x") is None
    # A hashed admin token is checked only against tokens of its shape.
    hand_made = "gva_some-admin-token-value"
    assert await Auth(None, {}, hash_secret(hand_made)).identify_bearer(hand_made) is None
    open_gate = Auth(None, {}, "")
    assert not await open_gate.enabled()


def test_log_lines_are_structured_and_redacted() -> None:
    import json
    import logging

    from supervisor.logs import JsonFormatter, KeyValueFormatter, Redactor

    record = logging.LogRecord("gpuvisor.x", logging.INFO, __file__, 1,
                               "token %s and Bearer abc.def and gv_0123abcd_SECRET", ("hunter2-long-secret",),
                               None)
    record.request_id = "req_1"
    assert Redactor(["hunter2-long-secret"]).filter(record)
    line = json.loads(JsonFormatter().format(record))
    assert line["request_id"] == "req_1" and line["level"] == "info"
    assert "hunter2" not in line["msg"] and "abc.def" not in line["msg"] and "SECRET" not in line["msg"]
    kv = KeyValueFormatter().format(record)
    assert "request_id=req_1" in kv and 'msg="token [redacted]' in kv
