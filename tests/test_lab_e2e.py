"""The lab on a real server: quantize -> serve, the GPU lease against streaming
inference, and a parent killed under a running job."""

from __future__ import annotations

import json
import signal
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from supervisor.models.demo import write_tiny_gguf
from tests.server import Server, short_tempdir


def submit(srv: Server, kind: str, params: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(srv.base_url + "/api/jobs", json={"kind": kind, "params": params}, timeout=30)
    assert r.status_code == 201, r.text
    return r.json()  # type: ignore[no-any-return]


def job(srv: Server, job_id: str) -> dict[str, Any]:
    return httpx.get(f"{srv.base_url}/api/jobs/{job_id}", timeout=10).json()  # type: ignore[no-any-return]


def wait_job(srv: Server, job_id: str, pred: Callable[[dict[str, Any]], bool], timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        j = job(srv, job_id)
        if pred(j):
            return j
        if time.monotonic() > deadline:
            raise TimeoutError(f"job never matched: {j}")
        time.sleep(0.05)


def chat(srv: Server, model: str = "tiny") -> httpx.Response:
    return httpx.post(srv.base_url + "/v1/chat/completions", timeout=60, json={
        "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})


@pytest.fixture
def models_dir() -> Path:
    models = short_tempdir("gvm")
    # 256-wide so the K-quants apply without fallbacks.
    write_tiny_gguf(models / "tiny.gguf", n_embd=256, n_ff=512)
    return models


def test_quantized_model_is_served(models_dir: Path, start_server: Callable[..., Server]) -> None:
    srv = start_server(models_dir)
    j = submit(srv, "quantize", {"model": "tiny", "type": "Q8_0", "output_name": "tiny-q8"})
    done = wait_job(srv, j["id"], lambda j: j["status"] in ("succeeded", "failed"))
    assert done["status"] == "succeeded", done
    out = Path(done["result"]["output_path"])
    assert out.parent == models_dir and out.stat().st_size < (models_dir / "tiny.gguf").stat().st_size
    deadline = time.monotonic() + 10
    while "tiny-q8" not in {m["id"] for m in httpx.get(srv.base_url + "/v1/models").json()["data"]}:
        assert time.monotonic() < deadline, "the quantized model never appeared"
        time.sleep(0.1)
    info = httpx.get(srv.base_url + "/api/models/tiny-q8").json()
    assert info["quantization"] == "Q8_0"
    r = chat(srv, "tiny-q8")
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def _stream(srv: Server, max_tokens: int, out: dict[str, Any]) -> None:
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", srv.base_url + "/v1/chat/completions", timeout=120, json={
            "model": "tiny", "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": "long story"}]}) as resp:
        for line in resp.iter_lines():
            if line == "data: [DONE]":
                out["done"] = True
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if len(events) == 5:
                    out["started"].set()
    out["events"] = events


def test_job_waits_for_a_stream_then_inference_gets_503(models_dir: Path,
                                                         start_server: Callable[..., Server]) -> None:
    srv = start_server(models_dir, env={"GPUVISOR_N_CTX": "8192"})
    out: dict[str, Any] = {"started": threading.Event()}
    streamer = threading.Thread(target=_stream, args=(srv, 3000, out))
    streamer.start()
    assert out["started"].wait(30)
    j = submit(srv, "sleep", {"steps": 40, "step_seconds": 0.05})
    # While the stream drains, the job waits; then it runs and inference is refused.
    running = wait_job(srv, j["id"], lambda j: j["status"] == "running" and j["pid"])
    refused = chat(srv)
    # A streamed Responses request is refused the same way, before any event.
    refused_stream = httpx.post(srv.base_url + "/v1/responses", timeout=30, json={
        "model": srv.model, "input": "hi", "stream": True, "max_output_tokens": 4})
    streamer.join(60)
    assert out.get("done") and not any("error" in e for e in out["events"]), "the stream was cut"
    assert refused.status_code == 503
    assert int(refused.headers["Retry-After"]) >= 1
    assert j["id"] in refused.json()["error"]["message"]
    assert refused_stream.status_code == 503, refused_stream.text
    assert int(refused_stream.headers["Retry-After"]) >= 1
    assert refused_stream.json()["error"]["code"] == refused.json()["error"]["code"]
    gpu = httpx.get(srv.base_url + "/api/gpu").json()
    assert running["status"] == "running"
    assert gpu["devices"][0]["holder"] is None or gpu["devices"][0]["holder"]["job_id"] == j["id"]
    wait_job(srv, j["id"], lambda j: j["status"] == "succeeded")
    assert chat(srv).status_code == 200  # serves again (loads on demand)


def test_stream_cut_after_drain_timeout_with_clear_error(models_dir: Path,
                                                         start_server: Callable[..., Server]) -> None:
    # A model trained for the whole context: the stream must outlast the drain
    # timeout, which 2,000 tokens (the fixture's context) did not always do.
    write_tiny_gguf(models_dir / "tiny.gguf", n_embd=256, n_ff=512, n_ctx=32768)
    srv = start_server(models_dir, env={"GPUVISOR_N_CTX": "32768", "GPUVISOR_DRAIN_TIMEOUT": "1"})
    out: dict[str, Any] = {"started": threading.Event()}
    streamer = threading.Thread(target=_stream, args=(srv, 30000, out))
    streamer.start()
    assert out["started"].wait(30)
    j = submit(srv, "sleep", {"steps": 5, "step_seconds": 0.05})
    streamer.join(60)
    # Cut by the eviction: its error object, then the stream's usual end.
    assert out["events"][-1]["error"]["code"] == "evicted" and out.get("done")
    wait_job(srv, j["id"], lambda j: j["status"] == "succeeded")


def test_parent_sigkill_during_a_job(models_dir: Path, start_server: Callable[..., Server]) -> None:
    srv = start_server(models_dir)
    j = submit(srv, "sleep", {"steps": 2000, "step_seconds": 0.05})
    running = wait_job(srv, j["id"], lambda j: j["status"] == "running" and j["pid"])
    job_pid = running["pid"]
    srv.stop(signal.SIGKILL)
    srv.start()
    after = job(srv, j["id"])
    assert after["status"] == "interrupted"
    assert "restart" in (after["error"] or after["message"] or "")
    assert not psutil.pid_exists(job_pid) or psutil.Process(job_pid).status() == psutil.STATUS_ZOMBIE
    with sqlite3.connect(srv.state_dir / "gpuvisor.db") as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
