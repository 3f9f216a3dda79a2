"""Fault injection on a real server: workers SIGKILLed at random moments, a
worker frozen under a stream, the parent SIGKILLed while it writes, a full
disk under a job and under the database, corrupt model files.

Long variants are marked ``slow`` and run with ``-m slow``; the default run
has short variants of the same scenarios. Complements test_worker_failures.py
and test_lab_e2e.py (single crashes, crash loops, one job under a parent kill).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.server import Server, short_tempdir

TERMINAL_RESPONSE_EVENTS = {"response.completed", "response.incomplete", "response.failed", "error"}
FINISHED_RESPONSE_STATUSES = {"completed", "incomplete", "failed", "cancelled"}
# Many kills in a short time must not trip the crash-loop breaker here.
# These tests kill workers from outside: no model is to be marked failed for
# it, and no caller refused for having been in flight (caller_crash_limit 0).
NO_CRASH_LIMIT = {"GPUVISOR_CRASH_LIMIT": "100000", "GPUVISOR_CALLER_CRASH_LIMIT": "0",
                  "GPUVISOR_N_CTX": "4096"}


def _models(tiny_model_path: Path, *extra: tuple[str, bytes]) -> Path:
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    for name, data in extra:
        (models / name).write_bytes(data)
    return models


def _long_variant(request: pytest.FixtureRequest) -> None:
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("the long variant runs with -m slow")


def _gone(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pids: list[int], timeout: float = 15) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if not _gone(pid)]
        if not alive:
            return []
        time.sleep(0.05)
    return alive


def _chat_ok(srv: Server, model: str = "tiny") -> None:
    r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=60, json={
        "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text


def _openai_error(resp: httpx.Response) -> dict[str, Any]:
    body = resp.json()
    assert set(body) == {"error"} and body["error"]["message"], body
    return body["error"]  # type: ignore[no-any-return]


# ---------------------------------------------------------------- worker SIGKILL under streams


@dataclass
class StreamResult:
    kind: str
    outcome: str  # "done", "error-event:<code>", "http-<status>:<code>"


@dataclass
class Killer:
    srv: Server
    rng: random.Random
    stop: threading.Event = field(default_factory=threading.Event)
    killed: list[int] = field(default_factory=list)
    busy_at_kill: list[bool] = field(default_factory=list)

    def run(self) -> None:
        while not self.stop.wait(self.rng.uniform(0.02, 0.6)):
            try:
                w = self.srv.worker()
            except (KeyError, httpx.TransportError):
                continue  # no worker yet: a restart is under way
            if w["state"] != "ready" or not w["pid"]:
                continue
            self.busy_at_kill.append(bool(w["in_flight"]))
            try:
                os.kill(int(w["pid"]), signal.SIGKILL)
            except ProcessLookupError:
                continue  # it died on its own between the two calls
            self.killed.append(int(w["pid"]))


def _prompt(rng: random.Random) -> str:
    # Some prompts are long so that kills also land during prefill. Each is
    # its own: the same prompt in flight at two kills would be refused as a
    # poison request, which these kills from outside are not.
    return "tell me a story " * (rng.choice([1, 1, 120])) + f"#{rng.getrandbits(32)}"


def _stream_chat(base: str, model: str, rng: random.Random) -> StreamResult:
    body = {"model": model, "stream": True, "max_tokens": rng.randint(10, 400), "ignore_eos": True,
            "messages": [{"role": "user", "content": _prompt(rng)}]}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=60) as resp:
        if resp.status_code != 200:
            resp.read()
            return StreamResult("chat", f"http-{resp.status_code}:{_openai_error(resp)['code']}")
        last = ""
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = line[6:]
    # A failed stream ends with its error object (then [DONE], as every stream does).
    final = json.loads(last)
    if "error" not in final:
        return StreamResult("chat", "done")
    return StreamResult("chat", f"error-event:{final['error']['code']}")


def _stream_responses(base: str, model: str, rng: random.Random) -> StreamResult:
    body = {"model": model, "stream": True, "max_output_tokens": rng.randint(10, 400), "ignore_eos": True,
            "input": _prompt(rng), "store": rng.random() < 0.5}
    with httpx.stream("POST", base + "/v1/responses", json=body, timeout=60) as resp:
        if resp.status_code != 200:
            resp.read()
            return StreamResult("responses", f"http-{resp.status_code}:{_openai_error(resp)['code']}")
        last: dict[str, Any] = {}
        for line in resp.iter_lines():
            if line.startswith("data: "):
                last = json.loads(line[6:])
    assert last.get("type") in TERMINAL_RESPONSE_EVENTS, last
    if last["type"] in ("response.completed", "response.incomplete"):  # incomplete: max_output_tokens
        return StreamResult("responses", "done")
    return StreamResult("responses", f"error-event:{last['type']}")


def _streams_under_kills(srv: Server, n_requests: int, seed: int) -> None:
    rng = random.Random(seed)
    seeds = [rng.random() for _ in range(n_requests)]
    killer = Killer(srv, random.Random(seed + 1))
    kill_thread = threading.Thread(target=killer.run, name="killer")
    kill_thread.start()

    def one(i: int) -> StreamResult:
        r = random.Random(seeds[i])
        call = _stream_chat if i % 2 == 0 else _stream_responses
        return call(srv.base_url, srv.model, r)

    try:
        with ThreadPoolExecutor(4) as pool:
            # httpx's read timeout turns a hung stream into an exception here.
            results = list(pool.map(one, range(n_requests), timeout=n_requests * 10))
    finally:
        killer.stop.set()
        kill_thread.join()
    outcomes = [r.outcome for r in results]
    allowed = ("done", "error-event:", "http-502:", "http-503:")
    assert all(o.startswith(allowed) for o in outcomes), outcomes
    assert killer.killed, "nothing was killed"
    assert any(killer.busy_at_kill), "no kill landed while a request was in flight"
    assert "done" in outcomes
    # The pool recovers: a fresh worker serves, nothing else is left over.
    w = srv.wait_worker(lambda w: w["state"] == "ready" and w["pid"] not in killer.killed, timeout=30)
    _chat_ok(srv)
    assert not _wait_gone(killer.killed), "a killed worker is still running"
    assert srv.proc is not None
    children = [c for c in psutil.Process(srv.proc.pid).children(recursive=True) if not _gone(c.pid)]
    assert [c.pid for c in children] == [w["pid"]], children
    assert len(srv.workers()) == 1


@pytest.fixture
def kill_server(tiny_model_path: Path, start_server: Callable[..., Server]) -> Server:
    return start_server(_models(tiny_model_path), env=NO_CRASH_LIMIT)


def test_worker_sigkill_at_random_moments(kill_server: Server) -> None:
    _streams_under_kills(kill_server, 16, seed=1)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_worker_sigkill_at_random_moments_long(kill_server: Server, request: pytest.FixtureRequest) -> None:
    _long_variant(request)
    for seed in range(3):
        _streams_under_kills(kill_server, 50, seed=seed)


def test_frozen_worker_fails_the_stream_and_is_replaced(kill_server: Server) -> None:
    srv = kill_server
    pid = srv.worker()["pid"]
    body = {"model": srv.model, "stream": True, "max_tokens": 3000, "ignore_eos": True,
            "messages": [{"role": "user", "content": "go"}]}
    last = ""
    t0 = 0.0
    with httpx.stream("POST", srv.base_url + "/v1/chat/completions", json=body, timeout=60) as resp:
        for n, line in enumerate(resp.iter_lines()):
            if line.startswith("data: ") and line != "data: [DONE]":
                last = line[6:]
            if n == 10:
                os.kill(pid, signal.SIGSTOP)
                t0 = time.monotonic()
    # Declared hung after the ping timeout (5 s in tests), then killed.
    assert time.monotonic() - t0 < 30
    assert "error" in json.loads(last), last
    srv.wait_worker(lambda w: w["state"] == "ready" and w["pid"] != pid, timeout=30)
    assert not _wait_gone([pid])
    _chat_ok(srv)


# ---------------------------------------------------------------- parent SIGKILL while writing


def _responses_writer(base: str, model: str, stop: threading.Event, got: list[str]) -> None:
    with httpx.Client(timeout=30) as http:
        i = 0
        while not stop.is_set():
            i += 1
            body = {"model": model, "input": f"note {i}", "max_output_tokens": 8, "store": True,
                    "background": i % 3 == 0}
            try:
                r = http.post(base + "/v1/responses", json=body)
            except httpx.TransportError:
                return  # the parent is gone
            if r.status_code == 200:
                got.append(r.json()["id"])


def test_parent_sigkill_while_responses_and_jobs_are_written(
        tiny_model_path: Path, start_server: Callable[..., Server]) -> None:
    srv = start_server(_models(tiny_model_path), env={"GPUVISOR_MAX_CONCURRENT_JOBS": "1"})
    running = httpx.post(srv.base_url + "/api/jobs", timeout=30, json={
        "kind": "sleep", "params": {"steps": 10_000, "step_seconds": 0.01, "use_device": False}}).json()
    queued = httpx.post(srv.base_url + "/api/jobs", timeout=30, json={
        "kind": "sleep", "params": {"steps": 1, "use_device": False, "tag": "queued"}}).json()
    stop = threading.Event()
    got: list[str] = []
    writers = [threading.Thread(target=_responses_writer, args=(srv.base_url, srv.model, stop, got))
               for _ in range(4)]
    for t in writers:
        t.start()
    deadline = time.monotonic() + 30
    while len(got) < 12 and time.monotonic() < deadline:
        time.sleep(0.02)
    job_pid = httpx.get(f"{srv.base_url}/api/jobs/{running['id']}", timeout=10).json()["pid"]
    worker_pid = srv.worker()["pid"]
    srv.stop(signal.SIGKILL)  # mid-write: the writers are still posting
    stop.set()
    for t in writers:
        t.join()
    assert len(got) >= 12
    assert not _wait_gone([p for p in (job_pid, worker_pid) if p]), "a child outlived the parent"

    db_path = srv.state_dir / "gpuvisor.db"
    srv.start()
    with sqlite3.connect(db_path) as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert db.execute("PRAGMA foreign_key_check").fetchall() == []
        rows = db.execute("SELECT id, status, body FROM responses").fetchall()
        positions = dict(db.execute(
            "SELECT response_id, group_concat(position) FROM response_input_items GROUP BY response_id"))
    stored = {}
    for rid, status, body in rows:
        obj = json.loads(body)
        # Complete or absent: the row, its body and its items agree and are finished.
        assert obj["id"] == rid and obj["status"] == status, (rid, status, obj["status"])
        assert status in FINISHED_RESPONSE_STATUSES, (rid, status)
        assert rid in positions, f"{rid} has no input items"
        assert sorted(int(p) for p in positions[rid].split(",")) == list(range(len(positions[rid].split(","))))
        stored[rid] = obj
    for rid in got:  # every answer a client received is there, and complete
        assert rid in stored, rid
        r = httpx.get(f"{srv.base_url}/v1/responses/{rid}", timeout=10)
        assert r.status_code == 200 and r.json()["status"] in FINISHED_RESPONSE_STATUSES
    jobs = {j["id"]: j for j in httpx.get(srv.base_url + "/api/jobs", timeout=10).json()["data"]}
    assert jobs[running["id"]]["status"] == "interrupted"
    assert queued["id"] in jobs, "a queued job was lost"
    assert jobs[queued["id"]]["status"] in ("queued", "running", "succeeded")
    _chat_ok(srv)


# ---------------------------------------------------------------- disk full


@dataclass
class Tmpfs:
    path: Path

    def fill(self, leave_bytes: int) -> Path:
        """Take all but ``leave_bytes`` of the free space."""
        filler = self.path / ".filler"
        chunk = b"\0" * 65536
        with filler.open("ab", buffering=0) as f:
            while (free := self.free()) > leave_bytes:
                try:
                    f.write(chunk[: min(len(chunk), free - leave_bytes)])
                except OSError:
                    break  # someone else took the rest: full is full
        return filler

    def free(self) -> int:
        stat = os.statvfs(self.path)
        return stat.f_bavail * stat.f_frsize


def _mount_tmpfs(path: Path, size: str) -> str | None:
    """Mount a tmpfs; the reason it cannot be done, or None."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        return f"mount -t tmpfs failed: {done.stderr.strip()}"
    return None


@pytest.fixture
def small_disk() -> Iterator[Callable[[str], Tmpfs]]:
    mounted: list[Path] = []

    def make(size: str) -> Tmpfs:
        path = short_tempdir("gvfull")
        why = _mount_tmpfs(path, size)
        if why is not None:
            shutil.rmtree(path, ignore_errors=True)
            pytest.skip(why)
        mounted.append(path)
        return Tmpfs(path)

    yield make
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)
        shutil.rmtree(path, ignore_errors=True)


def _wait_job(srv: Server, job_id: str, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        job = httpx.get(f"{srv.base_url}/api/jobs/{job_id}", timeout=10).json()
        if job["status"] in ("succeeded", "failed", "cancelled", "interrupted"):
            return job  # type: ignore[no-any-return]
        assert time.monotonic() < deadline, job
        time.sleep(0.05)


def test_disk_full_during_a_job_output_write(tiny_model_path: Path, start_server: Callable[..., Server],
                                             small_disk: Callable[[str], Tmpfs]) -> None:
    disk = small_disk("2m")
    rows = "".join(json.dumps({"instruction": f"q{i} " * 20, "output": f"a{i} " * 20}) + "\n"
                   for i in range(1500))
    (disk.path / "big.jsonl").write_text(rows)  # ~650 KB in, about as much out
    disk.fill(leave_bytes=64 * 1024)
    srv = start_server(_models(tiny_model_path), env={"GPUVISOR_DATASETS_DIR": str(disk.path)})
    r = httpx.post(srv.base_url + "/api/jobs", timeout=30, json={
        "kind": "dataset", "params": {"input": "big.jsonl", "eval_ratio": 0.1}})
    assert r.status_code == 201, r.text
    job = _wait_job(srv, r.json()["id"])
    assert job["status"] == "failed", job
    assert "No space left on device" in (job["error"] or ""), job["error"]
    _chat_ok(srv)
    with sqlite3.connect(srv.state_dir / "gpuvisor.db") as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_disk_full_during_database_writes(tiny_model_path: Path, small_disk: Callable[[str], Tmpfs]) -> None:
    disk = small_disk("24m")
    srv = Server(_models(tiny_model_path), state_dir=disk.path)
    # The server log stays off the full disk: it is the evidence.
    srv.log_path = short_tempdir("gvlog") / "server.log"
    try:
        srv.start()
        _chat_ok(srv)
        # A chatty job writes events while the disk fills up.
        job = httpx.post(srv.base_url + "/api/jobs", timeout=30, json={
            "kind": "sleep", "params": {"steps": 4000, "step_seconds": 0.005, "events_per_step": 20,
                                        "use_device": False, "tag": "x" * 200}}).json()
        job = _wait_job_status(srv, job["id"], "running")
        filler = disk.fill(leave_bytes=16 * 1024)
        refused = []
        for i in range(60):
            r = httpx.post(srv.base_url + "/v1/responses", timeout=30, json={
                "model": srv.model, "input": "y" * 500 + str(i), "max_output_tokens": 4, "store": True})
            if r.status_code != 200:
                refused.append((r.status_code, _openai_error(r)["code"]))
        assert refused, "the disk never filled up"
        assert set(refused) == {(507, "storage_full")}, refused
        # Still serving what needs no disk; reads work; the job process is gone.
        _chat_ok(srv)
        assert httpx.get(f"{srv.base_url}/api/jobs/{job['id']}", timeout=10).status_code == 200
        assert not _wait_gone([job["pid"]], timeout=30), "the job outlived its failed event writes"
        # With space back, writes work again and the file is intact; the job's
        # outcome, refused while the disk was full, is recorded now.
        filler.unlink()
        ended = _wait_job(srv, job["id"])
        assert ended["status"] == "failed", ended
        assert "disk" in ended["error"], ended
        r = httpx.post(srv.base_url + "/v1/responses", timeout=30, json={
            "model": srv.model, "input": "after", "max_output_tokens": 4, "store": True})
        assert r.status_code == 200, r.text
        assert httpx.get(f"{srv.base_url}/v1/responses/{r.json()['id']}", timeout=10).status_code == 200
        r = httpx.post(srv.base_url + "/api/jobs", timeout=30, json={
            "kind": "sleep", "params": {"steps": 1, "use_device": False}})
        assert r.status_code == 201, r.text
        assert _wait_job(srv, r.json()["id"])["status"] == "succeeded"
        with sqlite3.connect(disk.path / "gpuvisor.db") as db:
            assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        srv.stop(signal.SIGKILL)


def _wait_job_status(srv: Server, job_id: str, status: str, timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        job = httpx.get(f"{srv.base_url}/api/jobs/{job_id}", timeout=10).json()
        if job["status"] == status and job.get("pid"):
            return job  # type: ignore[no-any-return]
        assert time.monotonic() < deadline, job
        time.sleep(0.05)


# ---------------------------------------------------------------- corrupt model files


def test_corrupt_and_truncated_gguf(tiny_model_path: Path, start_server: Callable[..., Server]) -> None:
    real = tiny_model_path.read_bytes()
    header_cut = real[:48]  # inside the metadata: the header cannot be read
    data_cut = real[: len(real) // 2]  # header intact, tensor data missing
    scrambled = bytearray(real)
    scrambled[8:64] = random.Random(0).randbytes(56)
    srv = start_server(_models(tiny_model_path, ("headercut.gguf", header_cut), ("datacut.gguf", data_cut),
                              ("scrambled.gguf", bytes(scrambled)), ("notgguf.gguf", b"PK\x03\x04" * 64)),
                       env={"GPUVISOR_PRELOAD": "tiny"})
    listed = {m["id"]: m for m in httpx.get(srv.base_url + "/api/models", timeout=10).json()["data"]}
    for name in ("headercut", "scrambled", "notgguf", "datacut"):
        assert name in listed and listed[name]["usable"] is False, listed.get(name)
        assert listed[name]["reason"], listed[name]
    assert "truncated" in listed["datacut"]["reason"], listed["datacut"]
    for name in ("headercut", "scrambled", "notgguf", "datacut"):
        r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=60, json={
            "model": name, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code in (400, 404, 503), (name, r.status_code, r.text)
        err = _openai_error(r)
        assert err["code"] in ("model_failed", "model_unusable", "model_not_found", "model_unavailable"), err
        assert listed[name]["reason"] in err["message"], (name, err)
    # The library's reason is the answer: no worker was started for any of them.
    time.sleep(1.0)  # a worker start (or a restart storm) would show within this second
    assert [w["model"] for w in srv.workers()] == ["tiny"], srv.workers()
    _chat_ok(srv)
