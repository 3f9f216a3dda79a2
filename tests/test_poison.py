"""Poison requests: a request in flight during two worker crashes is refused
(400 request_crashed_worker) without reaching the worker, and its repeated
crashes do not push the model to ``failed`` for everybody."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from supervisor.workers.poison import PoisonTracker, fingerprint
from tests.server import Server, short_tempdir
from worker import protocol as p

pytestmark = pytest.mark.timeout(180)


def _gen(text: str, **params: object) -> p.Generate:
    return p.Generate(0, p.SamplingParams(**params),  # type: ignore[arg-type]
                      messages=[p.ChatMessage("user", text)])


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_fingerprint_ignores_ids_and_sampling_but_not_content() -> None:
    a = _gen("crash me", temperature=0.1, seed=1)
    b = _gen("crash me", temperature=0.9, seed=2, max_tokens=7)
    b.id, b.request_id = 42, "other"
    assert fingerprint("m", a) == fingerprint("m", b)
    assert fingerprint("m", a) != fingerprint("m", _gen("crash you"))
    assert fingerprint("m", a) != fingerprint("other-model", a)
    assert fingerprint("m", a) != fingerprint("m", _gen("crash me", json_object=True))
    t1 = p.Generate(0, prompt="x", template_vars={"a": 1, "b": 2})
    t2 = p.Generate(0, prompt="x", template_vars={"b": 2, "a": 1})
    assert fingerprint("m", t1) == fingerprint("m", t2)


def test_a_repeated_suspect_is_poison_and_its_crashes_count_once() -> None:
    clock = _Clock()
    t = PoisonTracker(max_entries=3, ttl=100.0, clock=clock)
    assert t.crashed(["x"]) is True  # a new suspect: the crash counts
    assert not t.is_poison("x")
    assert t.crashed(["x"]) is False  # only suspects in flight: it does not count again
    assert t.is_poison("x")
    # Innocent traffic: a crash with nothing, or anything new, in flight counts.
    assert t.crashed([]) is True
    assert t.crashed(["x", "y"]) is True
    assert t.is_poison("y") is False
    # Remembered for ttl after the last crash, at most max_entries.
    clock.now += 101
    assert not t.is_poison("x")
    for fp in ("a", "b", "c", "d"):
        t.crashed([fp])
        t.crashed([fp])
    assert not t.is_poison("a") and all(t.is_poison(fp) for fp in ("b", "c", "d"))


def _body(text: str) -> dict[str, object]:
    return {"model": "tiny", "max_tokens": 15000, "ignore_eos": True, "temperature": 0,
            "messages": [{"role": "user", "content": text}]}


async def _crash_during(srv: Server, body: dict[str, object]) -> httpx.Response:
    """Send ``body`` and SIGKILL the worker while it is in flight."""
    pid = int(srv.wait_worker(lambda w: w["state"] == "ready")["pid"])
    async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as c:
        task = asyncio.create_task(c.post("/v1/chat/completions", json=body))
        while not (await c.get("/api/workers")).json()["workers"][0]["in_flight"]:
            await asyncio.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
        resp = await task
    srv.wait_worker(lambda w: w["state"] == "ready" and w["pid"] != pid)
    return resp


def test_a_request_that_crashes_twice_is_refused_and_the_model_survives(
        tiny_model_path: Path, start_server: Callable[..., Server]) -> None:
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    srv = start_server(models, env={"GPUVISOR_CRASH_LIMIT": "3", "GPUVISOR_N_CTX": "16384"})
    poison = _body("the request that kills")
    for _ in range(2):
        r = asyncio.run(_crash_during(srv, poison))
        assert r.status_code == 502 and r.json()["error"]["code"] == "worker_crashed", r.text
    # The third identical request is refused before it reaches the worker.
    with httpx.Client(base_url=srv.base_url, timeout=30) as http:
        r = http.post("/v1/chat/completions", json={**poison, "max_tokens": 3, "temperature": 0.5})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "request_crashed_worker" and "twice" in err["message"]
        other = {"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
        assert http.post("/v1/chat/completions", json=other).status_code == 200
    # Two crashes happened, but the repeat counted once: one more crash
    # (innocent, nothing in flight) leaves the model at 2 of 3, not failed.
    w = srv.worker()
    assert w["state"] == "ready" and w["restarts"] == 2, w
    pid = srv.kill_worker()
    w = srv.wait_worker(lambda w: w["state"] in ("ready", "failed") and w["pid"] != pid)
    assert w["state"] == "ready", w
    assert httpx.get(srv.base_url + "/v1/models").json()["data"][0]["state"] != "failed"
