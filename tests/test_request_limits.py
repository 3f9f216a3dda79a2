"""The runaway guard: a request with no token limit of its own ends by
``default_max_tokens``, and any request ends by ``request_timeout_s``, as
``finish_reason: "length"`` (chat, completions) or ``status: incomplete``
with its reason (Responses); never a hang. The tiny model with
``ignore_eos`` writes until something stops it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.models.demo import write_tiny_gguf
from tests.server import Server, running, short_tempdir

CAP = 40
# The context the timed test runs in: far more tokens than the tiny model
# writes in TIME_LIMIT seconds (measured: about 10,000 per second at most).
LONG_CTX = 8192
TIME_LIMIT = 0.1


def _chat(srv: Server, **extra: Any) -> httpx.Response:
    return httpx.post(srv.base_url + "/v1/chat/completions", timeout=60, json={
        "model": srv.model, "messages": [{"role": "user", "content": "go on"}], "ignore_eos": True, **extra})


def _respond(srv: Server, **extra: Any) -> dict[str, Any]:
    r = httpx.post(srv.base_url + "/v1/responses", timeout=60, json={
        "model": srv.model, "input": "go on", "ignore_eos": True, "store": False, **extra})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def _limits(srv: Server) -> dict[str, Any]:
    models = httpx.get(srv.base_url + "/api/models", timeout=10).json()["data"]
    return next(m for m in models if m["id"] == srv.model)["limits"]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def capped(tiny_model_path: Path) -> Iterator[Server]:
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    with running(Server(models, env={"GPUVISOR_DEFAULT_MAX_TOKENS": str(CAP)})) as srv:
        yield srv


@pytest.fixture(scope="module")
def timed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    models = short_tempdir("gvm")
    write_tiny_gguf(models / "long.gguf", n_ctx=LONG_CTX)
    env = {"GPUVISOR_DEFAULT_MAX_TOKENS": "0", "GPUVISOR_REQUEST_TIMEOUT_S": str(TIME_LIMIT),
           "GPUVISOR_N_CTX": str(LONG_CTX)}
    with running(Server(models, env=env)) as srv:
        yield srv


def test_the_defaults_show_in_the_model_view(server: Server) -> None:
    assert _limits(server) == {"default_max_tokens": 16384, "request_timeout_s": 600.0, "queue_timeout_s": 120.0}


def test_a_request_without_a_limit_ends_by_the_default_cap(capped: Server) -> None:
    assert _limits(capped)["default_max_tokens"] == CAP
    r = _chat(capped)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == CAP
    # A limit of the request's own, above the default, is kept.
    assert _chat(capped, max_tokens=CAP + 5).json()["usage"]["completion_tokens"] == CAP + 5
    resp = _respond(capped)
    assert resp["status"] == "incomplete" and resp["incomplete_details"] == {"reason": "max_output_tokens"}
    assert resp["usage"]["output_tokens"] == CAP


def test_the_clock_ends_a_request_as_length(timed: Server) -> None:
    assert _limits(timed) == {"default_max_tokens": None, "request_timeout_s": TIME_LIMIT, "queue_timeout_s": 120.0}
    started = time.monotonic()
    body = _chat(timed).json()
    took = time.monotonic() - started
    choice, usage = body["choices"][0], body["usage"]
    assert choice["finish_reason"] == "length", body
    # Stopped by the clock: well before the context was full.
    assert 0 < usage["completion_tokens"] < LONG_CTX - usage["prompt_tokens"] - 1000, usage
    assert took < 30
    assert "ran for its time limit" in timed.log_text()


def test_the_clock_ends_a_stream_and_a_response(timed: Server) -> None:
    with httpx.stream("POST", timed.base_url + "/v1/chat/completions", timeout=60, json={
            "model": timed.model, "messages": [{"role": "user", "content": "go on"}], "ignore_eos": True,
            "stream": True}) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    finishes = [c["finish_reason"] for c in (json.loads(x)["choices"][0] for x in lines[:-1]) if c["finish_reason"]]
    assert finishes == ["length"]
    resp = _respond(timed)
    assert resp["status"] == "incomplete" and resp["incomplete_details"] == {"reason": "request_timeout"}, resp
    assert 0 < resp["usage"]["output_tokens"] < LONG_CTX - 1000
    # The slot it held is free again: a short request is answered at once.
    short = _chat(timed, max_tokens=3).json()
    assert short["usage"]["completion_tokens"] == 3 and short["choices"][0]["finish_reason"] == "length"
