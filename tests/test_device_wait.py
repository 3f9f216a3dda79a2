"""A chat refused because a job holds the only device: the 503 names the job
with its progress and time left, and a caller may wait in line for the
device instead (``GET /api/models/{id}/wait``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.errors import TooManyPlaces
from supervisor.lab.busy import WaitLine, eta_seconds
from tests.server import Server
from tests.test_lab_e2e import chat, models_dir, submit, wait_job  # noqa: F401 - fixture

__all__ = ["models_dir"]


def _wait(srv: Server, ticket: str | None = None, timeout_s: float = 0.2) -> dict[str, Any]:
    params: dict[str, Any] = {"timeout_s": timeout_s}
    if ticket:
        params["ticket"] = ticket
    r = httpx.get(f"{srv.base_url}/api/models/tiny/wait", params=params, timeout=40)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_a_chat_refused_for_a_job_can_wait_in_line(models_dir: Path,  # noqa: F811
                                                   start_server: Callable[..., Server]) -> None:
    srv = start_server(models_dir)
    first = submit(srv, "sleep", {"steps": 60, "step_seconds": 0.05})
    wait_job(srv, first["id"], lambda j: j["status"] == "running" and j["progress"] >= 0.1)
    refused = chat(srv)
    assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1
    err = refused.json()["error"]
    assert err["code"] == "gpu_busy" and err["type"] == "server_error"
    busy = err["job"]
    assert busy["id"] == first["id"] and busy["kind"] == "sleep" and busy["state"] == "holding"
    assert 0.0 < busy["progress"] < 1.0
    assert busy["eta_s"] is not None and busy["eta_s"] > 0
    assert busy["jobs_waiting"] == 0

    # A second job queues behind the first: a waiting chat is behind both.
    second = submit(srv, "sleep", {"steps": 10, "step_seconds": 0.05})
    wait_job(srv, second["id"], lambda j: j["status"] == "queued")
    mine = _wait(srv)
    assert mine["ready"] is False and mine["job"]["id"] == first["id"]
    assert mine["job"]["jobs_waiting"] == 1 and mine["chats_ahead"] == 0 and mine["position"] == 2
    theirs = _wait(srv)
    assert theirs["ticket"] != mine["ticket"] and theirs["chats_ahead"] == 1 and theirs["position"] == 3
    again = _wait(srv, mine["ticket"])
    assert again["ticket"] == mine["ticket"] and again["position"] == 2  # the place is kept

    deadline = time.monotonic() + 60
    while not (state := _wait(srv, mine["ticket"], timeout_s=5))["ready"]:
        assert time.monotonic() < deadline, state
    # Ready only once both jobs have given the device back.
    assert wait_job(srv, second["id"], lambda j: j["status"] != "queued")["status"] in ("running", "succeeded")
    assert wait_job(srv, first["id"], lambda j: j["status"] == "succeeded")
    answered = chat(srv)
    assert answered.status_code == 200, answered.text
    # The other chat, still polling, is ready at once and now first in line.
    assert _wait(srv, theirs["ticket"])["ready"] is True


def test_wait_refuses_bad_input(models_dir: Path, start_server: Callable[..., Server]) -> None:  # noqa: F811
    srv = start_server(models_dir)
    for bad in ("-1", "26", "nan", "soon"):
        r = httpx.get(f"{srv.base_url}/api/models/tiny/wait", params={"timeout_s": bad}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "timeout_s", r.text
    r = httpx.get(f"{srv.base_url}/api/models/nope/wait", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    # Nothing holds the device: ready at once.
    assert _wait(srv)["ready"] is True


def test_tickets_lapse_when_no_longer_polled() -> None:
    now = [0.0]
    line = WaitLine(ttl_s=60, max_tickets=2, clock=lambda: now[0])
    a = line.take("m", None, "key a")
    now[0] = 30
    b = line.take("m", None, "key b")
    assert line.ahead_of(b) == 1
    now[0] = 70  # a was last seen at 0: lapsed; b at 30: still waiting
    assert line.ahead_of(b) == 0 and len(line) == 1
    assert line.take("m", a.id, "key a").id != a.id  # a lapsed ticket gets a new place at the back


def test_a_ticket_is_its_callers_and_one_caller_holds_a_share() -> None:
    line = WaitLine(ttl_s=60, max_tickets=10, max_per_holder=3, clock=lambda: 0.0)
    alice = line.take("m", None, "key alice")
    bob = line.take("m", alice.id, "key bob")  # bob presents alice's ticket
    assert bob.id != alice.id and line.ahead_of(bob) == 1, "bob took alice's place"
    assert line.take("m", alice.id, "key alice") is alice  # hers still
    line.take("m", None, "key alice")
    line.take("m", None, "key alice")
    with pytest.raises(TooManyPlaces, match="3 places"):
        line.take("m", None, "key alice")
    assert line.take("m", None, "key carol").holder == "key carol"  # others still get in


def test_eta_from_progress() -> None:
    assert eta_seconds(0.25, started_at=100.0, now=110.0) == 30.0
    assert eta_seconds(0.005, started_at=100.0, now=110.0) is None  # too early to tell
    assert eta_seconds(0.5, started_at=None, now=110.0) is None
