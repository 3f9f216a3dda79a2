"""SIGTERM: streams end cleanly within the bound, jobs stop, nothing is left."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil

from tests.server import Server, poll_until, short_tempdir

LONG = {"GPUVISOR_N_CTX": "16384"}


def _models(tiny_model_path: Path) -> Path:
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    return models


class StreamReader(threading.Thread):
    """Reads one long chat stream in the background, keeping every event."""

    def __init__(self, srv: Server) -> None:
        super().__init__(daemon=True)
        self.srv = srv
        self.events: list[dict[str, Any]] = []
        self.started = threading.Event()
        self.ended_at = 0.0

    def run(self) -> None:
        body = {"model": self.srv.model, "stream": True, "max_tokens": 15000, "ignore_eos": True,
                "temperature": 0, "messages": [{"role": "user", "content": "go on"}]}
        with httpx.stream("POST", self.srv.base_url + "/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.events.append(json.loads(line[6:]))
                    if len(self.events) >= 5:
                        self.started.set()
        self.ended_at = time.monotonic()


def _descendants(srv: Server) -> list[psutil.Process]:
    assert srv.proc is not None
    children: list[psutil.Process] = psutil.Process(srv.proc.pid).children(recursive=True)
    return children


def _none_alive(procs: list[psutil.Process]) -> bool:
    _, alive = psutil.wait_procs(procs, timeout=5)
    return not alive


def test_sigterm_ends_streams_cleanly_and_leaves_nothing(
        tiny_model_path: Path, start_server: Callable[..., Server]) -> None:
    srv = start_server(_models(tiny_model_path), env={**LONG, "GPUVISOR_SHUTDOWN_TIMEOUT": "1"})
    reader = StreamReader(srv)
    reader.start()
    assert reader.started.wait(30)
    children = _descendants(srv)
    assert children  # the model worker
    t0 = time.monotonic()
    assert srv.stop(signal.SIGTERM) == 0
    reader.join(20)
    assert not reader.is_alive()
    # The stream ended with an error event, not a cut connection. The bound is
    # coarse (a 1 s drain, then the worker's stop): a hang, not a slow machine.
    assert reader.events[-1]["error"]["code"] == "shutting_down", reader.events[-1]
    assert reader.ended_at - t0 < 15
    assert _none_alive(children)
    assert "stopped" in srv.log_text()


def test_second_signal_shortens_the_drain(
        tiny_model_path: Path, start_server: Callable[..., Server]) -> None:
    srv = start_server(_models(tiny_model_path), env={**LONG, "GPUVISOR_SHUTDOWN_TIMEOUT": "60"})
    reader = StreamReader(srv)
    reader.start()
    assert reader.started.wait(30)
    assert srv.proc is not None
    srv.proc.send_signal(signal.SIGTERM)
    seen = len(reader.events)
    deadline = time.monotonic() + 10
    while len(reader.events) < seen + 20:  # still streaming: drain, not cut
        assert time.monotonic() < deadline and reader.is_alive()
        time.sleep(0.02)
    t1 = time.monotonic()
    srv.proc.send_signal(signal.SIGINT)
    reader.join(15)
    assert reader.events[-1]["error"]["code"] == "shutting_down"
    assert srv.stop(timeout=15) == 0
    assert time.monotonic() - t1 < 15


def test_running_job_is_stopped_and_marked_interrupted(
        tiny_model_path: Path, start_server: Callable[..., Server]) -> None:
    srv = start_server(short_tempdir("gvm"))
    url = srv.base_url
    job = httpx.post(url + "/api/jobs", json={"kind": "sleep", "params": {"steps": 10000, "step_seconds": 0.05}}).json()
    deadline = time.monotonic() + 30
    while httpx.get(f"{url}/api/jobs/{job['id']}").json()["status"] != "running":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    children = _descendants(srv)
    assert children
    assert srv.stop(signal.SIGTERM) == 0
    assert _none_alive(children)
    srv.start()
    assert httpx.get(f"{srv.base_url}/api/jobs/{job['id']}").json()["status"] == "interrupted"


def _running_stubborn_job(srv: Server) -> str:
    """A job that ignores SIGTERM, so only its grace (or a kill) ends it."""
    body = {"kind": "sleep", "params": {"steps": 100000, "step_seconds": 0.05, "ignore_term": True}}
    job: dict[str, Any] = httpx.post(srv.base_url + "/api/jobs", json=body).json()
    deadline = time.monotonic() + 30
    # Progress, not only "running": until the job has set up its signal
    # handling, a SIGTERM would still end it at once.
    while httpx.get(f"{srv.base_url}/api/jobs/{job['id']}").json()["progress"] <= 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return str(job["id"])


def test_job_grace_setting_bounds_how_long_a_job_may_take_to_stop(
        start_server: Callable[..., Server]) -> None:
    # The sleep kind's own grace is 10 s; the configured 1 s must win.
    srv = start_server(short_tempdir("gvm"), env={"GPUVISOR_JOB_GRACE_S": "1"})
    job_id = _running_stubborn_job(srv)
    children = _descendants(srv)
    t0 = time.monotonic()
    assert srv.stop(signal.SIGTERM) == 0
    assert time.monotonic() - t0 < 7
    assert _none_alive(children)
    srv.start()
    assert httpx.get(f"{srv.base_url}/api/jobs/{job_id}").json()["status"] == "interrupted"


def test_second_signal_kills_a_job_still_in_its_grace(
        start_server: Callable[..., Server]) -> None:
    srv = start_server(short_tempdir("gvm"), env={"GPUVISOR_JOB_GRACE_S": "120"})
    job_id = _running_stubborn_job(srv)
    children = _descendants(srv)
    assert srv.proc is not None
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    assert srv.proc.poll() is None  # still waiting for the job's grace
    t1 = time.monotonic()
    srv.proc.send_signal(signal.SIGINT)
    assert srv.proc.wait(15) == 0
    assert time.monotonic() - t1 < 7
    srv.stop()
    assert _none_alive(children)
    srv.start()
    assert httpx.get(f"{srv.base_url}/api/jobs/{job_id}").json()["status"] == "interrupted"


def test_sighup_rescans_and_keeps_serving(tiny_model_path: Path, start_server: Callable[..., Server]) -> None:
    # SIGHUP's default action ends a process: `systemctl reload` must not.
    models = _models(tiny_model_path)
    srv = start_server(models)
    assert srv.proc is not None
    (models / "second.gguf").symlink_to(tiny_model_path)
    srv.proc.send_signal(signal.SIGHUP)
    poll_until(lambda: [m["id"] for m in httpx.get(srv.base_url + "/v1/models", timeout=10).json()["data"]],
               lambda ids: "second" in ids, timeout=30)
    assert srv.proc.poll() is None
    assert "received SIGHUP: scanning the models dirs again" in srv.log_text()
    assert httpx.get(srv.base_url + "/healthz", timeout=10).status_code == 200
    assert srv.stop(signal.SIGTERM) == 0


class RawStream(threading.Thread):
    """One long stream (chat or Responses) read in the background, every data line kept."""

    def __init__(self, srv: Server, path: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.srv, self.path, self.body = srv, path, body
        self.data: list[str] = []
        self.started = threading.Event()

    def run(self) -> None:
        with httpx.stream("POST", self.srv.base_url + self.path, json=self.body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.data.append(line[6:])
                    if len(self.data) >= 8:
                        self.started.set()


def test_ctrl_c_says_what_it_waits_for_and_streams_end_complete(
        tiny_model_path: Path, start_server: Callable[..., Server]) -> None:
    # Streams far longer than the drain (the tiny model writes thousands of tokens a second).
    srv = start_server(_models(tiny_model_path), env={"GPUVISOR_N_CTX": "65536", "GPUVISOR_SHUTDOWN_TIMEOUT": "1",
                                                      "GPUVISOR_PARALLEL": "2"})
    chat = RawStream(srv, "/v1/chat/completions", {
        "model": srv.model, "stream": True, "max_tokens": 60000, "ignore_eos": True,
        "messages": [{"role": "user", "content": "go on"}]})
    responses = RawStream(srv, "/v1/responses", {
        "model": srv.model, "stream": True, "max_output_tokens": 60000, "ignore_eos": True, "input": "go on"})
    for reader in (chat, responses):
        reader.start()
        assert reader.started.wait(30)
    assert srv.stop(signal.SIGINT) == 0
    for reader in (chat, responses):
        reader.join(20)
        assert not reader.is_alive()
    log = srv.log_text()
    assert ("shutting down: waiting up to 1s for 2 open requests (streams included) to finish; "
            "press Ctrl-C again (or send a second SIGTERM) to stop now") in log, log
    # Chat: the error object, then the stream's usual end.
    assert chat.data[-1] == "[DONE]", chat.data[-3:]
    assert json.loads(chat.data[-2])["error"]["code"] == "shutting_down"
    # Responses: one terminal event that says why.
    last = json.loads(responses.data[-1])
    assert last["type"] == "response.failed", last
    assert last["response"]["status"] == "failed"
    assert "shutting down" in last["response"]["error"]["message"], last["response"]["error"]
    assert not any(json.loads(d)["type"] in ("response.completed", "response.incomplete")
                   for d in responses.data)
