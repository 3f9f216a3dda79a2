"""Crashes are blamed on who asked: a caller whose requests keep crashing
workers is refused (429 ``crash_cooldown``), one-byte variants of a crasher
included, and the model does not go ``failed`` for everyone because of one
caller. Without authentication the caller is the client's address."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from supervisor.workers.crash_keys import KEY_CRASH_LIMIT, CrashCooldown, KeyCrashes, crash_counts
from supervisor.workers.poison import PoisonTracker
from supervisor.workers.queue import Pending
from tests.server import REPO, Server, poll_until, short_tempdir
from worker import protocol as p

pytestmark = pytest.mark.timeout(240)

ADMIN = "gva_0123abcd_" + "A" * 43
# Room for a long generation to stay in flight; a model failed at its second counted crash.
CRASH_ENV = {"GPUVISOR_N_CTX": "16384", "GPUVISOR_CRASH_LIMIT": "2"}


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _pend(text: str, caller: str) -> Pending:
    msg = p.Generate(0, p.SamplingParams(), messages=[p.ChatMessage("user", text)])
    return Pending(0, msg, caller=caller)


def test_blame_is_shared_by_the_callers_in_flight_and_expires() -> None:
    clock = _Clock()
    keys = KeyCrashes(limit=3, window=100.0, clock=clock)
    for _ in range(2):
        keys.crashed(["key a", "key a", ""])  # its two requests, and one of the parent's own
        clock.now += 1
    assert keys.blame("key a") == 2 and keys.retry_after("key a") is None
    keys.crashed(["key a", "key b"])  # shared: half each
    assert keys.blame("key a") == 2.5 and keys.blame("key b") == 0.5
    keys.crashed(["key a"])
    wait = keys.retry_after("key a")
    # Refused until the oldest crash (at 0) is older than the window: 100 s after it.
    assert wait == 100 - 2
    with pytest.raises(CrashCooldown) as info:
        keys.check("key a")
    assert info.value.status == 429 and info.value.retry_after == wait
    assert info.value.headers["Retry-After"] == str(wait)
    keys.check("key b")
    keys.check("")  # the parent's own requests are never refused
    clock.now += wait
    assert keys.retry_after("key a") is None


def test_one_callers_crashes_count_toward_the_model_once() -> None:
    clock = _Clock()
    poison, keys = PoisonTracker(clock=clock), KeyCrashes(clock=clock)
    # The first crash of a fresh caller counts, its variants' crashes do not.
    assert crash_counts(poison, keys, "m", [_pend("crash me", "key a")]) is True
    assert crash_counts(poison, keys, "m", [_pend("crash me!", "key a")]) is False
    assert crash_counts(poison, keys, "m", [_pend("crash me?", "key a"), _pend("hi", "key b")]) is False
    # A crash with nothing in flight, or only fresh callers and requests, counts.
    assert crash_counts(poison, keys, "m", []) is True
    assert crash_counts(poison, keys, "m", [_pend("hello", "key c")]) is True
    assert crash_counts(poison, keys, "m", [_pend("parent", "")]) is True


def test_with_refusal_per_caller_off_the_model_limit_is_the_guard() -> None:
    """caller_crash_limit = 0: nobody is refused, and each fresh crash counts
    toward the model's own crash limit again (the rule before callers)."""
    clock = _Clock()
    poison, keys = PoisonTracker(clock=clock), KeyCrashes(limit=0, clock=clock)
    for text in ("crash me", "crash me!", "crash me?", "crash me."):
        assert crash_counts(poison, keys, "m", [_pend(text, "key a")]) is True
    assert keys.retry_after("key a") is None
    keys.check("key a")


# ------------------------------------------------------------------ served


def _add_key(state: Path, name: str) -> str:
    out = subprocess.run([sys.executable, "-m", "supervisor", "keys", "add", name, "--state-dir", str(state)],
                         capture_output=True, text=True, cwd=REPO, timeout=60, check=True)
    return out.stdout.strip()


def _body(text: str) -> dict[str, object]:
    return {"model": "tiny", "max_tokens": 15000, "ignore_eos": True, "temperature": 0,
            "messages": [{"role": "user", "content": text}]}


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _worker(srv: Server) -> dict[str, object]:
    """The model's worker as the admin sees it (auth may be on)."""
    workers = httpx.get(srv.base_url + "/api/workers", headers=_bearer(ADMIN), timeout=10).json()["workers"]
    return dict(workers[0]) if workers else {}


def _wait_worker(srv: Server, pred: Callable[[dict[str, object]], bool]) -> dict[str, object]:
    return poll_until(lambda: _worker(srv), lambda w: bool(w) and pred(w), timeout=60)


async def _crash_during(srv: Server, body: dict[str, object], headers: dict[str, str]) -> httpx.Response:
    """Send ``body``; abort the worker (as the engine's failed assertions do)
    while it is in flight. A refused request comes back without a crash."""
    pid = int(str(_wait_worker(srv, lambda w: w["state"] == "ready")["pid"]))
    async with httpx.AsyncClient(base_url=srv.base_url, timeout=60, headers=headers) as c:
        task = asyncio.create_task(c.post("/v1/chat/completions", json=body))
        while not task.done() and not (await c.get("/api/workers", headers=_bearer(ADMIN))
                                       ).json()["workers"][0]["in_flight"]:
            await asyncio.sleep(0.02)
        if task.done():
            return await task
        os.kill(pid, signal.SIGABRT)
        resp = await task
    after = _wait_worker(srv, lambda w: w["state"] == "failed" or (w["state"] == "ready" and w["pid"] != pid))
    assert after["state"] == "ready", after  # not failed for everyone
    return resp


def test_a_key_whose_variants_keep_crashing_is_refused_and_the_model_survives(
        tiny_model_path: Path, start_server: Callable[..., Server]) -> None:
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    srv = start_server(models, env={**CRASH_ENV, "GPUVISOR_ADMIN_TOKEN": ADMIN}, wait_ready=False)
    alice = _add_key(srv.state_dir, "alice")
    bob = _add_key(srv.state_dir, "bob")
    srv.wait_ready()
    with httpx.Client(base_url=srv.base_url, timeout=60) as http:
        assert http.post("/v1/chat/completions", headers=_bearer(bob), json={
            "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}).status_code == 200
    # The crasher, then four variants of it that differ by one byte each.
    statuses = []
    for variant in ["crash", "crasH", "crAsh", "cRash", "Crash"]:
        r = asyncio.run(_crash_during(srv, _body(f"the request that kills: {variant}"), _bearer(alice)))
        statuses.append(r.status_code)
        if r.status_code == 429:
            refusal = r
    assert statuses == [502] * KEY_CRASH_LIMIT + [429] * (5 - KEY_CRASH_LIMIT), statuses
    err = refusal.json()["error"]
    assert err["code"] == "crash_cooldown" and err["type"] == "requests", err
    assert int(refusal.headers["Retry-After"]) > 60 and refusal.headers["x-should-retry"] == "false"
    with httpx.Client(base_url=srv.base_url, timeout=60) as http:
        innocent = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        # Alice is refused on every route that reaches a worker, even for an innocent request...
        assert http.post("/v1/chat/completions", headers=_bearer(alice), json=innocent).status_code == 429
        r = http.post("/v1/responses", headers=_bearer(alice),
                      json={"model": "tiny", "input": "hi", "max_output_tokens": 2})
        assert r.status_code == 429 and r.json()["error"]["code"] == "crash_cooldown", r.text
        # ...while the model is not failed, and serves bob.
        assert http.post("/v1/chat/completions", headers=_bearer(bob), json=innocent).status_code == 200
        listed = http.get("/v1/models", headers=_bearer(bob)).json()["data"]
        assert [m["state"] for m in listed if m["id"] == "tiny"] == ["ready"], listed
    w = _worker(srv)
    # Three crashes, of which the model counted alice's first only (its limit is 2).
    assert w["state"] == "ready" and w["restarts"] == KEY_CRASH_LIMIT, w


def test_without_auth_the_callers_are_client_addresses(
        tiny_model_path: Path, start_server: Callable[..., Server]) -> None:
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    # Behind a trusted proxy (loopback here), X-Forwarded-For names the client.
    srv = start_server(models, env={**CRASH_ENV, "GPUVISOR_TRUSTED_PROXIES": "127.0.0.1"})
    mallory, carol = {"X-Forwarded-For": "192.0.2.66"}, {"X-Forwarded-For": "192.0.2.7"}
    for i in range(KEY_CRASH_LIMIT):
        r = asyncio.run(_crash_during(srv, _body(f"crash {i}"), mallory))
        assert r.status_code == 502, r.text
    with httpx.Client(base_url=srv.base_url, timeout=60) as http:
        innocent = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        r = http.post("/v1/chat/completions", headers=mallory, json=innocent)
        assert r.status_code == 429 and r.json()["error"]["code"] == "crash_cooldown", r.text
        assert http.post("/v1/chat/completions", headers=carol, json=innocent).status_code == 200
    assert _worker(srv)["state"] == "ready"
