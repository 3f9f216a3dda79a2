"""The output ceiling: a token limit above the model's context is a 400
naming its field (chat, legacy completions, Responses), clamped instead while
the worker still loads; and two bounds on odd numbers: a replay cursor
(``starting_after``) parsed strictly before the stream's head, and integers
beyond 64 bits in a tool schema once the model has crash history."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.models.demo import write_tiny_gguf
from tests.real_templates import by_name
from tests.server import Server, running, short_tempdir

pytestmark = pytest.mark.timeout(180)

CTX = 1024  # the context of FAST_ENV (tests/server.py)
HUGE = 2**63


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Two models, so that none is preloaded: the first request finds its worker loading."""
    models = short_tempdir("gvo")
    write_tiny_gguf(models / "alpha.gguf")
    write_tiny_gguf(models / "beta.gguf")
    with running(Server(models, model="alpha")) as srv:
        yield srv


def _error(r: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err: dict[str, Any] = r.json()["error"]
    return err


def _chat(http: httpx.Client, model: str, **extra: Any) -> httpx.Response:
    return http.post("/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], **extra})


def test_a_limit_above_the_context_is_refused_naming_its_field(two: Server) -> None:
    with httpx.Client(base_url=two.base_url, timeout=60) as http:
        for field in ("max_tokens", "max_completion_tokens"):
            for value in (HUGE, CTX + 1):
                err = _error(_chat(http, "alpha", **{field: value}))
                assert err["param"] == field and err["code"] == "max_tokens_exceeds_context", err
                assert str(CTX) in err["message"]
        # Streamed: the same 400, before any 200.
        err = _error(_chat(http, "alpha", max_tokens=HUGE, stream=True))
        assert err["param"] == "max_tokens"
        # Beyond 64 bits: refused too, never sent on.
        assert _error(_chat(http, "alpha", max_tokens=2**70))["param"] == "max_tokens"
        # The context itself is a limit a request may set.
        ok = _chat(http, "alpha", max_tokens=CTX, ignore_eos=True)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= CTX, ok.text
        for stream in (False, True):
            r = http.post("/v1/responses", json={"model": "alpha", "input": "hi", "max_output_tokens": HUGE,
                                                 "stream": stream, "store": False})
            err = _error(r)
            assert err["param"] == "max_output_tokens" and err["code"] == "max_tokens_exceeds_context", err
        r = http.post("/v1/completions", json={"model": "alpha", "prompt": "hi", "max_tokens": HUGE})
        assert _error(r)["param"] == "max_tokens"


def test_a_limit_sent_while_the_model_loads_is_clamped_to_its_context(two: Server) -> None:
    """Legacy completions do not wait for the worker's facts: the limit is
    clamped to the context the worker is started with, then refused once known."""
    with httpx.Client(base_url=two.base_url, timeout=60) as http:
        assert all(w["model"] != "beta" for w in two.workers())
        body = {"model": "beta", "prompt": "hi", "max_tokens": HUGE, "ignore_eos": True}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        done = r.json()
        assert done["choices"][0]["finish_reason"] == "length"
        assert 0 < done["usage"]["completion_tokens"] <= CTX
        err = _error(http.post("/v1/completions", json=body))
        assert err["param"] == "max_tokens" and err["code"] == "max_tokens_exceeds_context"


def test_starting_after_is_parsed_strictly_before_the_head(two: Server) -> None:
    with httpx.Client(base_url=two.base_url, timeout=60) as http:
        created = http.post("/v1/responses", json={"model": "alpha", "input": "hi", "max_output_tokens": 4,
                                                   "background": True})
        assert created.status_code == 200, created.text
        rid = created.json()["id"]
        for raw in (str(HUGE), "9" * 400, "+5", " 7", "7 ", "\u0663", "1_0", "--1", "-2", "", "0x10"):
            r = http.get(f"/v1/responses/{rid}", params={"stream": "true", "starting_after": raw})
            err = _error(r)
            assert err["param"] == "starting_after", (raw, err)
            assert r.headers["content-type"].startswith("application/json")
        for raw in ("-1", "0", "2", str(HUGE - 1)):
            with http.stream("GET", f"/v1/responses/{rid}",
                             params={"stream": "true", "starting_after": raw}) as r:
                assert r.status_code == 200, raw
                r.read()
        # The log holds no traceback for any of them.
        assert "Traceback" not in two.log_text()


def _tool_chat(http: httpx.Client) -> httpx.Response:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 2**70, "minimum": -(2**70)}}}
    return _chat(http, "alpha", max_tokens=4, tools=[
        {"type": "function", "function": {"name": "count", "parameters": schema}}])


async def _crash_during(srv: Server) -> None:
    """SIGKILL the worker while a request is in flight: the model has crash history."""
    pid = int(srv.wait_worker(lambda w: w["state"] == "ready")["pid"])
    async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as c:
        task = asyncio.create_task(c.post("/v1/chat/completions", json={
            "model": "alpha", "max_tokens": 15000, "ignore_eos": True,
            "messages": [{"role": "user", "content": "go on"}]}))
        while not (await c.get("/api/workers")).json()["workers"][0]["in_flight"]:
            await asyncio.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
        assert (await task).status_code == 502
    srv.wait_worker(lambda w: w["state"] == "ready" and w["pid"] != pid)


def test_huge_integers_in_a_tool_schema_answer_the_same_after_a_crash(tmp_path: Path) -> None:
    models = short_tempdir("gvo")
    # A template with tools of its own: the schema goes to the worker as the client sent it.
    write_tiny_gguf(models / "alpha.gguf", n_ctx=16384, chat_template=by_name("qwen2.5-instruct").template)
    with running(Server(models, env={"GPUVISOR_N_CTX": "16384"})) as srv, \
            httpx.Client(base_url=srv.base_url, timeout=60) as http:
        before = _tool_chat(http)
        assert before.status_code < 500, before.text
        asyncio.run(_crash_during(srv))
        after = _tool_chat(http)
        # Before the fix: a 500 (the crash-history fingerprint could not encode the integer).
        assert after.status_code == before.status_code, after.text
        if after.status_code != 200:
            assert after.json()["error"]["code"] == before.json()["error"]["code"]
        assert "OverflowError" not in srv.log_text()
