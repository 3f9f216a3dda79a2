"""Authentication hardening: no hashing for tokens of no known id or shape,
a failure budget per client, auth that stays on after the last key is
revoked, refusal rather than open service on a public address, and probes
that tell anonymous callers only ok / not ok."""

from __future__ import annotations

import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.api import auth as auth_mod
from supervisor.api.auth import (
    Auth,
    FailureLimiter,
    Principal,
    TooManyRequests,
    hash_secret,
    new_api_key,
)
from tests.server import REPO, Server, running, short_tempdir

pytestmark = pytest.mark.timeout(120)

ADMIN = "gva_0123abcd_" + "A" * 43


def gpuvisor(state_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "supervisor", *args, "--state-dir", str(state_dir)],
                          capture_output=True, text=True, cwd=REPO, timeout=60, check=False)


def _bad_tokens(n: int) -> list[str]:
    """Junk, API-key-shaped with ids nobody holds, and admin-shaped with a wrong id."""
    shapes: list[Callable[[], str]] = [
        lambda: "not-a-key-" + secrets.token_hex(8),
        lambda: new_api_key()[1],
        lambda: f"gva_{secrets.token_hex(4)}_{secrets.token_urlsafe(32)}",
        lambda: "x" * 5000,
    ]
    return [shapes[i % len(shapes)]() for i in range(n)]


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------- 8: hashing and the budget


async def test_unknown_tokens_cost_no_scrypt(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = auth_mod.verify_secret

    def counting(secret: str, stored: str) -> bool:
        calls.append(secret)
        return real(secret, stored)

    monkeypatch.setattr(auth_mod, "verify_secret", counting)
    key_id, key = new_api_key()
    gate = Auth(None, auth_mod.parse_config_keys([f"lab:{key_id}:{hash_secret(key)}"]), hash_secret(ADMIN),
                failures=FailureLimiter(limit=1000))
    assert await gate.identify_bearer(ADMIN, "10.0.0.1") == Principal("admin", "admin")
    assert await gate.identify_bearer(key, "10.0.0.1") == Principal("lab", "user")
    assert len(calls) == 2
    for token in _bad_tokens(100):
        assert await gate.identify_bearer(token, "10.0.0.2") is None
    # Once the admin token is known, only tokens with its id would be hashed.
    assert calls[2:] == []
    # A wrong secret for a real id costs one scrypt (and counts as a failure).
    assert await gate.identify_bearer(key[:-4] + "AAAA", "10.0.0.2") is None
    assert len(calls) == 3


async def test_failures_are_budgeted_per_client() -> None:
    clock = _Clock()
    key_id, key = new_api_key()
    gate = Auth(None, auth_mod.parse_config_keys([f"lab:{key_id}:{hash_secret(key)}"]), "",
                clock=clock, failures=FailureLimiter(limit=5, window=60.0, clock=clock))
    assert await gate.identify_bearer(key, "10.0.0.1") is not None  # verified once: remembered
    for _ in range(5):
        assert await gate.identify_bearer("junk", "10.0.0.1") is None
    with pytest.raises(TooManyRequests) as refused:
        await gate.identify_bearer("junk", "10.0.0.1")
    assert refused.value.status == 429 and int(refused.value.headers["Retry-After"]) in (12, 13)
    # Over budget, a never-verified key would need a scrypt: refused too.
    other_id, other = new_api_key()
    gate.config_keys[other_id] = auth_mod.KeyRecord(other_id, "other", hash_secret(other), "config")
    with pytest.raises(TooManyRequests):
        await gate.identify_bearer(other, "10.0.0.1")
    # The key verified before still works, another address is unaffected,
    # an IPv6 /64 counts as one client, and the budget refills with time.
    assert await gate.identify_bearer(key, "10.0.0.1") is not None
    assert await gate.identify_bearer("junk", "10.0.0.9") is None
    for n in range(5):
        assert await gate.identify_bearer("junk", f"2001:db8::{n + 1}") is None
    with pytest.raises(TooManyRequests):
        await gate.identify_bearer("junk", "2001:db8::ffff")
    clock.now += 13  # one failure refilled (5 per 60 s)
    assert await gate.identify_bearer("junk", "10.0.0.1") is None


@pytest.fixture(scope="module")
def hashed_admin() -> Iterator[Server]:
    # A budget large enough that the timing below measures hashing, not the 429s.
    env = {"GPUVISOR_ADMIN_TOKEN": hash_secret(ADMIN), "GPUVISOR_AUTH_FAILURE_LIMIT": "100000"}
    with running(Server(short_tempdir("gvm"), env=env)) as srv:
        yield srv


def test_a_hundred_bad_tokens_are_cheap(hashed_admin: Server) -> None:
    tokens = _bad_tokens(100)
    with httpx.Client(base_url=hashed_admin.base_url, timeout=30) as http:
        t0 = time.monotonic()
        codes = {http.get("/v1/models", headers={"Authorization": f"Bearer {t}"}).status_code for t in tokens}
        took = time.monotonic() - t0
        assert codes == {401}
        # The admin token itself still works (one scrypt, then remembered).
        assert http.get("/v1/models", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
    # One scrypt each (~50-150 ms) made this 5-15 s; without hashing it is
    # a few ms per request. A coarse bound.
    assert took < 3.0, took


def test_failure_budget_over_http(start_server: Callable[..., Server]) -> None:
    srv = start_server(short_tempdir("gvm"), env={"GPUVISOR_ADMIN_TOKEN": ADMIN,
                                                   "GPUVISOR_AUTH_FAILURE_LIMIT": "3"})
    with httpx.Client(base_url=srv.base_url, timeout=10) as http:
        good = {"Authorization": f"Bearer {ADMIN}"}
        for _ in range(3):
            assert http.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        r = http.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert http.post("/login", data={"token": "wrong"}).status_code == 429
        # The probes stay open (anonymous answer), the right token still works.
        assert http.get("/healthz", headers={"Authorization": "Bearer wrong"}).json() == {"status": "ok"}
        assert http.get("/v1/models", headers=good).status_code == 200


# ---------------------------------------------------------------- 9: auth stays on


def _wait_status(url: str, status: int, headers: dict[str, str] | None = None, timeout: float = 10) -> httpx.Response:
    """Keys added or revoked by the CLI take effect within the cache TTL (1 s)."""
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(url, headers=headers, timeout=10)
        if r.status_code == status or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def test_revoking_the_last_key_keeps_auth_on(start_server: Callable[..., Server]) -> None:
    srv = start_server(short_tempdir("gvm"))
    models = srv.base_url + "/v1/models"
    assert httpx.get(models).status_code == 200  # nothing configured, loopback: open
    key = gpuvisor(srv.state_dir, "keys", "add", "only").stdout.strip()
    assert _wait_status(models, 401).status_code == 401
    assert httpx.get(models, headers={"Authorization": f"Bearer {key}"}).status_code == 200
    assert gpuvisor(srv.state_dir, "keys", "revoke", "only").returncode == 0
    assert httpx.get(models, headers={"Authorization": f"Bearer {key}"}).status_code == 401
    # Still on, and saying why nobody can get in.
    deadline = time.monotonic() + 10
    while "no admin token or API key is active" not in (r := httpx.get(models)).text:
        assert r.status_code == 401, r.text
        assert time.monotonic() < deadline, r.text
        time.sleep(0.05)
    assert r.status_code == 401
    # A restart does not turn it off either.
    srv.restart()
    assert httpx.get(srv.base_url + "/v1/models").status_code == 401


def test_auth_off_is_the_explicit_switch(start_server: Callable[..., Server]) -> None:
    state = short_tempdir("gv")
    assert gpuvisor(state, "keys", "add", "k").returncode == 0
    srv = Server(short_tempdir("gvm"), state_dir=state, env={"GPUVISOR_AUTH": "off"})
    with running(srv):
        assert httpx.get(srv.base_url + "/v1/models").status_code == 200


def test_open_service_on_a_public_address_is_refused(start_server: Callable[..., Server]) -> None:
    # A stored key does not protect anything with auth = "off": the start-up
    # check refuses the public address in one line, before listening.
    state = short_tempdir("gv")
    assert gpuvisor(state, "keys", "add", "k").returncode == 0
    srv = Server(short_tempdir("gvm"), state_dir=state, env={"GPUVISOR_AUTH": "off"})
    refused = subprocess.run(
        [sys.executable, "-m", "supervisor", "serve", "--host", "0.0.0.0", "--port", "0",
         "--state-dir", str(state), "--models-dir", str(srv.models_dir)],
        capture_output=True, text=True, cwd=REPO, timeout=60, check=False, env=srv.env())
    assert refused.returncode == 2, refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and 'auth = "off"' in lines[0] and "allow_unauthenticated" in lines[0], lines
    assert "listening" not in refused.stdout
    # Allowed explicitly: it serves, and says so in one warning line at start.
    with running(Server(short_tempdir("gvm"), state_dir=state, args=["--host", "0.0.0.0"],
                        env={"GPUVISOR_AUTH": "off", "GPUVISOR_ALLOW_UNAUTHENTICATED": "true"})) as srv:
        assert httpx.get(srv.base_url + "/v1/models").status_code == 200
        warnings = [ln for ln in srv.log_text().splitlines() if ln.startswith("gpuvisor: warning:")]
        assert len(warnings) == 1 and "authentication is off" in warnings[0] and "0.0.0.0" in warnings[0]


async def test_auth_on_requires_a_key_from_the_start() -> None:
    gate = Auth(None, {}, "", mode="on")
    assert await gate.enabled() and not await gate.any_credential()
    assert not await Auth(None, {}, "", mode="auto").enabled()
    assert not await Auth(None, {}, ADMIN, mode="off").enabled()
    assert Auth(None, {}, "", bind_host="0.0.0.0").exposed
    assert not Auth(None, {}, "", bind_host="::1").exposed
    assert not Auth(None, {}, "", bind_host="0.0.0.0", allow_unauthenticated=True).exposed


# ---------------------------------------------------------------- 14: probes


@pytest.fixture
def with_worker(tiny_model_path: Path) -> Iterator[Server]:
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)  # the only model: preloaded
    with running(Server(models, env={"GPUVISOR_ADMIN_TOKEN": ADMIN})) as srv:
        yield srv


def _workers(srv: Server) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 30
    while True:
        body = httpx.get(srv.base_url + "/healthz", headers={"Authorization": f"Bearer {ADMIN}"}).json()
        if body["workers"] and body["workers"][0].get("pid") or time.monotonic() > deadline:
            return list(body["workers"])
        time.sleep(0.05)


def test_probes_tell_anonymous_callers_only_ok(with_worker: Server) -> None:
    workers = _workers(with_worker)
    assert workers and workers[0]["pid"]  # the signed-in view keeps its details
    url = with_worker.base_url
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        health = httpx.get(url + "/healthz", headers=headers)
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        ready = httpx.get(url + "/readyz", headers=headers)
        assert ready.status_code == 200 and ready.json() == {"ready": True}
        assert str(workers[0]["pid"]) not in health.text + ready.text
    detailed = httpx.get(url + "/readyz", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    assert detailed["workers"][0]["model"] == with_worker.model
