"""Cancel, crash, crash loop, bad model, queue bound, hang, parent death."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests.server import Server, running, short_tempdir

LONG = {"GPUVISOR_N_CTX": "16384"}


def _models(tiny_model_path: Path, *extra: tuple[str, bytes]) -> Path:
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    for name, data in extra:
        (models / name).write_bytes(data)
    return models


def _long_stream_body(model: str, max_tokens: int = 15000) -> dict[str, object]:
    return {"model": model, "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "messages": [{"role": "user", "content": "go on forever"}]}


@pytest.fixture
def long_server(tiny_model_path: Path, start_server: Callable[..., Server]) -> Server:
    return start_server(_models(tiny_model_path), env=LONG)


def test_closing_a_stream_cancels_generation(long_server: Server) -> None:
    srv = long_server
    with httpx.stream("POST", srv.base_url + "/v1/chat/completions",
                      json=_long_stream_body(srv.model)) as resp:
        for n, _ in enumerate(resp.iter_lines()):
            if n > 20:
                break
    # The worker sees the cancel: its cancelled count rises and it goes idle
    # long before 15,000 tokens could have been generated.
    w = srv.wait_worker(lambda w: w["stats"] and w["stats"]["requests_cancelled"] >= 1
                        and not w["stats"]["busy"], timeout=20)
    assert w["stats"]["tokens_generated"] < 15000
    t0 = time.monotonic()
    r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=30, json={
        "model": srv.model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    assert time.monotonic() - t0 < 10


def test_worker_crash_mid_stream_ends_with_error_and_restarts(long_server: Server) -> None:
    srv = long_server
    pid = srv.worker()["pid"]
    events: list[dict[str, object]] = []
    with httpx.stream("POST", srv.base_url + "/v1/chat/completions",
                      json=_long_stream_body(srv.model), timeout=30) as resp:
        killed_at = None
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[6:]))
            if len(events) == 10:
                os.kill(pid, signal.SIGKILL)
                killed_at = time.monotonic()
        assert killed_at is not None
        assert time.monotonic() - killed_at < 10
    assert events[-1]["error"]["code"] == "worker_crashed"  # type: ignore[index]
    w = srv.wait_worker(lambda w: w["state"] == "ready" and w["pid"] != pid)
    assert w["restarts"] == 1
    assert w["restarts_by_cause"] == {"exited": 1, "hung": 0, "ipc_broken": 0, "handshake_failed": 0}
    r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=30, json={
        "model": srv.model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text


def test_non_streaming_request_gets_502_when_the_worker_dies(long_server: Server) -> None:
    srv = long_server
    pid = srv.worker()["pid"]

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(timeout=60) as c:
            task = asyncio.create_task(c.post(srv.base_url + "/v1/chat/completions", json={
                **_long_stream_body(srv.model), "stream": False}))
            while not (await c.get(srv.base_url + "/api/workers")).json()["workers"][0]["in_flight"]:
                await asyncio.sleep(0.02)
            os.kill(pid, signal.SIGKILL)
            return await task

    resp = asyncio.run(run())
    assert resp.status_code == 502
    assert resp.json()["error"]["code"] == "worker_crashed"
    # A request that crashed a worker is not retried by the SDKs: it may be a
    # poison request that would crash the restarted worker too.
    assert resp.headers["x-should-retry"] == "false"


def test_crash_loop_marks_the_model_failed(tiny_model_path: Path,
                                           start_server: Callable[..., Server]) -> None:
    srv = start_server(_models(tiny_model_path), env={"GPUVISOR_CRASH_LIMIT": "3"})
    for _ in range(3):
        srv.kill_worker()
        srv.wait_worker(lambda w: w["state"] != "ready")
    w = srv.wait_worker(lambda w: w["state"] == "failed")
    assert "3 crashes" in w["reason"]
    models = httpx.get(srv.base_url + "/v1/models").json()["data"]
    assert models[0]["state"] == "failed" and "crashes" in models[0]["reason"]
    r = httpx.post(srv.base_url + "/v1/chat/completions", json={
        "model": srv.model, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_failed"
    # Waiting does not fix a failed model: no Retry-After, and the SDKs' own
    # retries are told off (x-should-retry), so a client fails at once.
    assert "Retry-After" not in r.headers and r.headers["x-should-retry"] == "false"
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", timeout=30)  # default retries
    t0 = time.monotonic()
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model=srv.model, messages=[{"role": "user", "content": "x"}])
    assert time.monotonic() - t0 < 5, "the SDK retried a failed model"
    health = httpx.get(srv.base_url + "/healthz").json()
    assert health["workers"][0]["state"] == "failed"


def test_bad_gguf_is_refused_from_its_header_without_a_worker(tiny_model_path: Path,
                                                             start_server: Callable[..., Server]) -> None:
    models = _models(tiny_model_path, ("broken.gguf", b"GGUF" + b"\x00" * 64))
    srv = start_server(models, env={"GPUVISOR_PRELOAD": "tiny"})
    r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=60, json={
        "model": "broken", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "model_failed" and r.headers["x-should-retry"] == "false"
    models_list = {m["id"]: m for m in httpx.get(srv.base_url + "/v1/models").json()["data"]}
    assert models_list["broken"]["state"] == "unusable"
    assert models_list["broken"]["reason"] in r.json()["error"]["message"]
    time.sleep(1.0)  # a worker start (or a restart storm) would show within this second
    assert [w["model"] for w in srv.workers()] == ["tiny"], srv.workers()
    assert models_list["tiny"]["state"] == "ready"


def test_queue_bound_gives_503_with_retry_after(tiny_model_path: Path,
                                               start_server: Callable[..., Server]) -> None:
    srv = start_server(_models(tiny_model_path), env={**LONG, "GPUVISOR_QUEUE_LIMIT": "1", "GPUVISOR_PARALLEL": "1"})
    url = srv.base_url + "/v1/chat/completions"

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(timeout=60) as c:
            async with c.stream("POST", url, json=_long_stream_body(srv.model)) as first:
                lines = first.aiter_lines()  # keep a reference: dropping it closes the stream
                await anext(lines)
                queued = asyncio.create_task(c.post(url, json={**_long_stream_body(srv.model, 4),
                                                                "stream": False}))
                while (await c.get(srv.base_url + "/api/workers")).json()["workers"][0]["queued"] < 1:
                    await asyncio.sleep(0.02)
                third = await c.post(url, json={**_long_stream_body(srv.model, 4), "stream": False})
                # A streamed Responses request is refused before any event, too.
                third_stream = await c.post(srv.base_url + "/v1/responses", json={
                    "model": srv.model, "input": "hi", "stream": True, "max_output_tokens": 4})
                assert third_stream.status_code == 503, third_stream.text
                assert int(third_stream.headers["Retry-After"]) >= 1
                assert third_stream.json()["error"]["code"] == "queue_full"
            # Closing the first stream lets the queued request run.
            assert (await queued).status_code == 200
            return third

    third = asyncio.run(run())
    assert third.status_code == 503
    assert int(third.headers["Retry-After"]) >= 1
    assert third.json()["error"]["code"] == "queue_full"


def test_hung_worker_is_killed_and_restarted(long_server: Server) -> None:
    srv = long_server
    pid = srv.worker()["pid"]
    os.kill(pid, signal.SIGSTOP)
    w = srv.wait_worker(lambda w: w["state"] == "ready" and w["pid"] != pid, timeout=40)
    assert "hung" in (srv.log_text())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert w["restarts"] == 1
    assert w["restarts_by_cause"]["hung"] == 1 and w["restarts_by_cause"]["exited"] == 0
    metrics = httpx.get(srv.base_url + "/metrics", timeout=10).text
    assert f'gpuvisor_worker_restarts_total{{cause="hung",mode="generate",model="{srv.model}"}} 1.0' in metrics \
        or f'gpuvisor_worker_restarts_total{{model="{srv.model}",mode="generate",cause="hung"}} 1.0' in metrics, metrics


def test_worker_exits_when_the_parent_is_killed(tiny_model_path: Path,
                                                start_server: Callable[..., Server]) -> None:
    srv = start_server(_models(tiny_model_path))
    pid = srv.worker()["pid"]
    assert psutil.pid_exists(pid)
    srv.stop(signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and psutil.pid_exists(pid):
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    gone = not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert gone, "the worker outlived its parent"


def test_sigterm_stops_the_parent_and_its_workers(tiny_model_path: Path,
                                                  start_server: Callable[..., Server]) -> None:
    srv = start_server(_models(tiny_model_path))
    pid = srv.worker()["pid"]
    assert srv.stop(signal.SIGTERM) == 0
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_large_worker_log_is_rotated_when_the_worker_starts(tiny_model_path: Path) -> None:
    srv = Server(_models(tiny_model_path))
    logs = srv.state_dir / "logs"
    logs.mkdir(parents=True)
    with open(logs / "tiny.log", "wb") as f:
        f.truncate(33 << 20)  # sparse: past the 32 MiB bound without writing it
    with running(srv):
        assert (logs / "tiny.log.1").stat().st_size == 33 << 20
        assert (logs / "tiny.log").stat().st_size < 1 << 20  # a fresh log for this worker


def test_readyz_is_not_fooled_by_an_embedding_worker(tiny_model_path: Path,
                                                     start_server: Callable[..., Server]) -> None:
    srv = start_server(_models(tiny_model_path), env={"GPUVISOR_CRASH_LIMIT": "1"})
    r = httpx.post(srv.base_url + "/v1/embeddings", json={"model": srv.model, "input": "hi"}, timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.get(srv.base_url + "/readyz").json()["models"] == {"tiny": True}
    srv.kill_worker()
    srv.wait_worker(lambda w: w["state"] == "failed")
    ready = httpx.get(srv.base_url + "/readyz")
    assert ready.status_code == 503, ready.text
    assert ready.json()["models"] == {"tiny": False}
    # The embedding worker still serves embeddings.
    assert httpx.post(srv.base_url + "/v1/embeddings", json={"model": srv.model, "input": "hi"},
                      timeout=60).status_code == 200
