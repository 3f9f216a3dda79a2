"""The output ceiling: a token limit above the model's context (the chat
page's 100000, 2^63, more than 64 bits) is clamped to the context, so the
request runs until its slot is full and ends as by its limit (chat, legacy
completions, Responses, streamed or not, the worker loaded or still
loading); and two bounds on odd numbers: a replay cursor (``starting_after``)
parsed strictly before the stream's head, and integers beyond 64 bits in a
tool schema once the model has crash history."""

from __future__ import annotations

import asyncio
import json
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


def _length_within_context(r: httpx.Response) -> None:
    assert r.status_code == 200, r.text
    done = r.json()
    assert {c["finish_reason"] for c in done["choices"]} == {"length"}, done
    # The prompt shares the slot: each answer stops short of the whole context.
    assert 0 < done["usage"]["completion_tokens"] < CTX * len(done["choices"]), done["usage"]


def _sse_data(r: httpx.Response) -> list[str]:
    assert r.status_code == 200, r.text
    return [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]


def test_a_limit_above_the_context_is_clamped_to_it(two: Server) -> None:
    with httpx.Client(base_url=two.base_url, timeout=120) as http:
        # Beyond 64 bits (the worker's frames cannot carry it), 2^63, and the chat page's 100000.
        _length_within_context(_chat(http, "alpha", max_tokens=2**70, ignore_eos=True))
        _length_within_context(_chat(http, "alpha", max_completion_tokens=HUGE, ignore_eos=True))
        _length_within_context(_chat(http, "alpha", max_tokens=100_000, ignore_eos=True, n=2))
        # Streamed: a 200 whose choice ends by its length, then [DONE].
        data = _sse_data(_chat(http, "alpha", max_tokens=HUGE, ignore_eos=True, stream=True))
        assert data[-1] == "[DONE]"
        ends = [c["finish_reason"] for d in data[:-1] for c in json.loads(d)["choices"] if c["finish_reason"]]
        assert ends == ["length"], ends
        # Responses: incomplete by max_output_tokens.
        r = http.post("/v1/responses", json={"model": "alpha", "input": "hi", "max_output_tokens": 2**70,
                                             "ignore_eos": True, "store": False})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["status"] == "incomplete", body
        assert body["incomplete_details"]["reason"] == "max_output_tokens"
        assert 0 < body["usage"]["output_tokens"] < CTX
        data = _sse_data(http.post("/v1/responses", json={
            "model": "alpha", "input": "hi", "max_output_tokens": HUGE, "ignore_eos": True,
            "stream": True, "store": False}))
        assert json.loads(data[-1])["type"] == "response.incomplete", data[-1]
        # A limit within the context is kept as it is.
        r = _chat(http, "alpha", max_tokens=5, ignore_eos=True)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5, r.text
    assert "Traceback" not in two.log_text()


def test_a_limit_sent_while_the_model_loads_is_clamped_to_its_context(two: Server) -> None:
    """Legacy completions do not wait for the worker's facts: the limit is
    clamped to the context the worker is started with, and to the worker's
    own once it is known."""
    with httpx.Client(base_url=two.base_url, timeout=120) as http:
        assert all(w["model"] != "beta" for w in two.workers())
        body = {"model": "beta", "prompt": "hi", "max_tokens": 2**70, "ignore_eos": True}
        _length_within_context(http.post("/v1/completions", json=body))
        _length_within_context(http.post("/v1/completions", json=body))


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
