"""Diagnostics a person meets first: a native worker crash explained (signal,
phase, likely cause, the end of the worker log) in the API and the UI; a port
in use; the CLI finding the service and saying when it is down or the Hub is
unreachable; polled reads kept out of the INFO log."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.logs import access_level
from supervisor.workers.crash import (
    FAULT_MARKER,
    crash_reason,
    exit_is_news,
    exit_reason,
    load_failure_reason,
    read_log_tail,
)
from tests.browser import DESKTOP, PageWatch
from tests.server import FAST_ENV, REPO, Server, short_tempdir

pytestmark = pytest.mark.timeout(120)

ADMIN = "admin-token-for-diagnostics-0123"
# A crashed worker waits this long before its restart: the test reads it crashed.
SLOW_RESTART = {"GPUVISOR_RESTART_BACKOFF_MIN": "60", "GPUVISOR_RESTART_BACKOFF_MAX": "60"}


def _models(tiny_model_path: Path) -> Path:
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    return models


def gpuvisor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("GPUVISOR_")}
    return subprocess.run([sys.executable, "-m", "supervisor", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=90, check=False,
                          env={**base, **FAST_ENV, **(env or {}), "PYTHONPATH": str(REPO)})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _model(srv: Server, headers: dict[str, str] | None = None) -> dict[str, Any]:
    r = httpx.get(f"{srv.base_url}/api/models/{srv.model}", headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


# ---------------------------------------------------------------- crash reasons


def test_crash_reason_names_the_signal_the_phase_and_the_likely_cause() -> None:
    assert crash_reason(signal.SIGSEGV, "decoding").startswith(
        "the model worker crashed: SIGSEGV (segmentation fault) in native code while decoding")
    sigill = crash_reason(signal.SIGILL, "loading")
    assert "SIGILL (illegal instruction) in native code while loading" in sigill
    assert "CPU lacks instructions the engine build needs" in sigill
    assert crash_reason(signal.SIGKILL, "serving").startswith(
        "the model worker was killed: SIGKILL (killed from outside) while serving")
    assert "out-of-memory" in crash_reason(signal.SIGKILL, "serving")
    assert crash_reason(signal.SIGUSR2, "serving") == "the model worker crashed: SIGUSR2 while serving"
    # A signal the parent sent (a hang it aborted) keeps the parent's reason.
    assert exit_reason(-signal.SIGABRT, "serving", "no answer to ping (hung)", True) == "no answer to ping (hung)"
    # The worker's own signal is the news, even when the parent saw only a broken handshake.
    assert "SIGSEGV" in exit_reason(-signal.SIGSEGV, "loading", "handshake failed: worker exited", False)
    assert exit_reason(1, "serving", None, False) == "the model worker exited with code 1 while serving (see its log)"
    # Whether the reason is the parent's own account (its requests then say whose crash it was).
    assert not exit_is_news(-signal.SIGABRT, True) and not exit_is_news(None, False)
    assert exit_is_news(-signal.SIGSEGV, False) and exit_is_news(1, False)
    assert "the engine rejects the file" in load_failure_reason("cannot load x.gguf: bad tensor")


def test_log_tail_is_bounded_this_process_only_and_keeps_the_fault_line(tmp_path: Path) -> None:
    log = tmp_path / "tiny.log"
    log.write_text("Fatal Python error: an older crash\nold process output\n")
    start = log.stat().st_size
    threads = [f'  File "engine.py", line {i} in decode' for i in range(60)]
    with log.open("a") as f:
        f.write("INFO worker: loaded\n" + "x" * 5000 + "\n")
        f.write("Fatal Python error: Segmentation fault\n\n" + "\n".join(threads) + "\n")
    tail = read_log_tail(log, start).splitlines()
    # The fault line leads (its stacks pushed it out of the last lines), then the last lines.
    assert tail[0] == "Fatal Python error: Segmentation fault" and tail[1] == "…"
    assert tail[-1] == threads[-1] and len(tail) == 20
    assert "older crash" not in "\n".join(tail)
    assert all(len(line) <= 301 for line in read_log_tail(log, 0, lines=100).splitlines())
    assert read_log_tail(tmp_path / "never-written.log") == ""
    # A log rotated since the process began (now smaller than its start): read from 0.
    log.write_text("Fatal Python error: Bus error\n")
    assert read_log_tail(log, start).startswith(FAULT_MARKER)


@pytest.fixture
def slow_restart(tiny_model_path: Path, start_server: Callable[..., Server]) -> Server:
    return start_server(_models(tiny_model_path), env={**SLOW_RESTART, "GPUVISOR_N_CTX": "16384"})


def test_native_crash_while_decoding_is_explained(slow_restart: Server) -> None:
    srv = slow_restart
    pid = srv.wait_worker(lambda w: w["state"] == "ready")["pid"]
    body = {"model": srv.model, "stream": True, "max_tokens": 15000, "ignore_eos": True, "temperature": 0,
            "messages": [{"role": "user", "content": "go on forever"}]}
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", srv.base_url + "/v1/chat/completions", json=body, timeout=30) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if len(events) == 5:
                    os.kill(pid, signal.SIGSEGV)
    error = events[-1]["error"]
    assert error["code"] == "worker_crashed" and "SIGSEGV (segmentation fault)" in error["message"], error

    model = _model(srv)
    assert model["state"] == "crashed"
    assert model["reason"].startswith(
        "the model worker crashed: SIGSEGV (segmentation fault) in native code while decoding"), model
    # faulthandler's report of the signal is in the tail, with the stack after it.
    assert "Fatal Python error: Segmentation fault" in model["log_tail"], model["log_tail"]
    assert len(model["log_tail"].splitlines()) <= 20
    listed = {m["id"]: m for m in httpx.get(srv.base_url + "/v1/models", timeout=10).json()["data"]}
    assert listed[srv.model]["reason"] == model["reason"] and "log_tail" not in listed[srv.model]

    log = httpx.get(f"{srv.base_url}/api/models/{srv.model}/log", timeout=10)
    assert log.status_code == 200 and log.headers["Content-Type"].startswith("text/plain")
    assert "Segmentation fault" in log.text
    short = httpx.get(f"{srv.base_url}/api/models/{srv.model}/log?tail=200", timeout=10)
    assert 0 < len(short.content) <= 200 and log.text.endswith(short.text)
    assert httpx.get(f"{srv.base_url}/api/models/{srv.model}/log?tail=0", timeout=10).status_code == 400
    assert httpx.get(f"{srv.base_url}/api/models/{srv.model}/log?mode=x", timeout=10).status_code == 400
    assert httpx.get(f"{srv.base_url}/api/models/nope/log", timeout=10).status_code == 404
    assert "its log:" in srv.log_text() and "SIGSEGV" in srv.log_text()


def test_worker_log_is_for_the_admin_only(tiny_model_path: Path, start_server: Callable[..., Server]) -> None:
    srv = start_server(_models(tiny_model_path), env={"GPUVISOR_ADMIN_TOKEN": ADMIN}, wait_ready=False)
    added = gpuvisor("keys", "add", "reader", "--state-dir", str(srv.state_dir))
    assert added.returncode == 0, added.stderr
    key = {"Authorization": f"Bearer {added.stdout.strip()}"}
    admin = {"Authorization": f"Bearer {ADMIN}"}
    url = f"{srv.base_url}/api/models/{srv.model}/log"
    assert httpx.get(url, timeout=10).status_code == 401
    deadline = time.monotonic() + 10
    while (r := httpx.get(url, headers=key, timeout=10)).status_code == 401:  # the key cache refreshes each second
        assert time.monotonic() < deadline, r.text
        time.sleep(0.1)
    assert r.status_code == 403, r.text
    assert httpx.get(url, headers=admin, timeout=10).status_code == 200
    # The model list itself stays readable with any key.
    assert httpx.get(srv.base_url + "/api/models", headers=key, timeout=10).status_code == 200


# ---------------------------------------------------------------- the UI


def test_ui_shows_a_failed_model_its_reason_and_log(browser: Any, tiny_model_path: Path,
                                                    start_server: Callable[..., Server]) -> None:
    # One crash is one too many here: the model is failed, not restarting.
    srv = start_server(_models(tiny_model_path), env={"GPUVISOR_CRASH_LIMIT": "1"})
    pid = srv.wait_worker(lambda w: w["state"] == "ready")["pid"]
    os.kill(pid, signal.SIGSEGV)
    srv.wait_worker(lambda w: w["state"] == "failed")
    context = browser.new_context(viewport=DESKTOP)
    context.set_default_timeout(20_000)
    pg = context.new_page()
    watch = PageWatch(srv.base_url)
    watch.attach(pg)
    try:
        pg.goto(f"{srv.base_url}/#/")
        status = pg.locator("section[aria-label=Service] .badge")
        status.filter(has_text="1 model failed").wait_for()
        assert status.inner_text() != "ok"
        # Listed apart from the loaded models (it holds no memory), with why.
        failed = pg.locator(f'.failed-models li[data-failed-model="{srv.model}"]')
        assert "SIGSEGV" in failed.locator(".model-reason").inner_text()
        assert pg.locator(f'tr[data-model="{srv.model}"]').count() == 0

        pg.goto(f"{srv.base_url}/#/models")
        failure = pg.locator(f'tr.model-failure[data-failed-model="{srv.model}"]')
        failure.wait_for()
        reason = failure.locator(".failure-reason").inner_text()
        assert "SIGSEGV (segmentation fault) in native code while serving" in reason, reason
        assert "Fatal Python error: Segmentation fault" in failure.locator("pre.log").inner_text()
        link = failure.locator("a.worker-log")
        assert link.get_attribute("href") == f"api/models/{srv.model}/log"
        text = pg.evaluate("(href) => fetch(href).then((r) => r.text())", link.get_attribute("href"))
        assert "Segmentation fault" in text

        # Recovery: load it again from the page.
        failure.get_by_role("button", name="Load again").click()
        pg.locator(f'tr[data-model="{srv.model}"] .badge', has_text="ready").wait_for()
        assert failure.count() == 0
        pg.goto(f"{srv.base_url}/#/")
        status.filter(has_text="ok").wait_for()
        watch.check()
    finally:
        context.close()


# ---------------------------------------------------------------- start-up and CLI


def test_port_in_use_is_one_line_and_starts_no_worker(tiny_model_path: Path) -> None:
    state = short_tempdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = gpuvisor("serve", "--port", str(port), "--state-dir", str(state),
                     "--models-dir", str(_models(tiny_model_path)))
    assert r.returncode == 1, r
    assert r.stderr.strip().splitlines() == [
        f"gpuvisor: port {port} is in use (is gpuvisor already running? use --port)"], r.stderr
    # Bound before anything started: no database, no worker (and so no worker log).
    assert not (state / "logs").exists() and not (state / "gpuvisor.db").exists()


def test_cli_finds_the_service_by_port_and_says_when_it_is_down(server: Server) -> None:
    state = ["--state-dir", str(server.state_dir)]
    assert f"lab UI: http://127.0.0.1:{server.port}/" in server.log_text()
    status = gpuvisor("status", "--port", str(server.port), *state)
    assert status.returncode == 0 and f"gpuvisor at http://127.0.0.1:{server.port}: ok" in status.stdout, status
    # The port from the environment, as serve reads it.
    by_env = gpuvisor("status", *state, env={"GPUVISOR_PORT": str(server.port)})
    assert by_env.returncode == 0, by_env
    closed = str(_free_port())
    for cmd in (["status"], ["pull", "acme/tiny-GGUF:Q8_0"]):
        r = gpuvisor(*cmd, "--port", closed, *state)
        assert r.returncode == 1, r
        lines = (r.stdout + r.stderr).strip().splitlines()
        assert lines == [(f"gpuvisor is not reachable at http://127.0.0.1:{closed} (connection refused): "
                          "is it running? Start it with `gpuvisor serve`, or pass the --port or --url "
                          "it listens on")], lines
    version = gpuvisor("--version")
    assert version.returncode == 0 and version.stdout.startswith("gpuvisor "), version
    keys = gpuvisor("keys", "list", "--state-dir", str(short_tempdir()))
    assert keys.returncode == 0 and keys.stdout.startswith("no keys"), keys


def test_offline_pull_names_the_endpoint_and_the_alternatives(tiny_model_path: Path,
                                                              start_server: Callable[..., Server]) -> None:
    hub = f"http://127.0.0.1:{_free_port()}"  # nothing listens: the Hub is unreachable
    cache = short_tempdir("gvhf")
    env = {"HF_ENDPOINT": hub, "HF_HUB_CACHE": str(cache), "HF_HUB_DISABLE_TELEMETRY": "1"}
    srv = start_server(_models(tiny_model_path), env=env)
    r = gpuvisor("pull", "acme/tiny-GGUF:Q8_0", "--port", str(srv.port), "--state-dir", str(srv.state_dir),
                 env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert f"could not reach the Hugging Face Hub at {hub}" in out
    assert "copy a .gguf file into the models directory" in out
    assert "set HF_ENDPOINT" in out and "HF_HUB_OFFLINE=1" in out
    assert "Traceback" not in out


# ---------------------------------------------------------------- quieter logs


def test_access_levels() -> None:
    for path in ("/healthz", "/api/gpu", "/api/models", "/api/models/a/b", "/api/jobs", "/api/jobs/job_1"):
        assert access_level("GET", path, 200) == logging.DEBUG, path
    assert access_level("GET", "/api/models", 500) == logging.INFO
    assert access_level("GET", "/api/models/nope", 404) == logging.INFO
    assert access_level("POST", "/api/models/x/load", 200) == logging.INFO
    assert access_level("GET", "/v1/models", 200) == logging.INFO
    assert access_level("GET", "/api/modelsx", 200) == logging.INFO


def test_polled_reads_stay_out_of_the_info_log(server: Server) -> None:
    def get(path: str, rid: str) -> None:
        httpx.get(server.base_url + path, headers={"X-Request-Id": rid}, timeout=10)

    get("/healthz", "poll-healthz")
    get("/api/models", "poll-models")
    get("/api/gpu", "poll-gpu")
    get("/api/jobs?limit=5", "poll-jobs")
    get("/api/models/no-such-model", "miss-404")
    r = httpx.post(f"{server.base_url}/api/models/{server.model}/load", json={},
                   headers={"X-Request-Id": "change-load"}, timeout=60)
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 10
    while "change-load" not in server.log_text():  # requests were sequential: the rest is logged by now
        assert time.monotonic() < deadline, server.log_text()[-2000:]
        time.sleep(0.05)
    text = server.log_text()
    assert "miss-404" in text
    for rid in ("poll-healthz", "poll-models", "poll-gpu", "poll-jobs"):
        assert rid not in text, rid
