"""A vLLM worker under the parent's policy, as any worker: its environment
from the allowlist (``VLLM_*`` included), the lease draining and evicting it
for a job, and a SIGKILL mid-stream answered with a clean error, a restart
with backoff and no engine process left behind.

One server for the module; each test leaves the worker ready again (vLLM's
start takes 15-30 s on the CPU). Needs the vLLM environment (``make
install-vllm``) and the train extra (the tiny model is made with
transformers)."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from supervisor.config import default_vllm_python
from tests.server import Server, running, short_tempdir
from tests.test_lab_e2e import chat, submit, wait_job

pytest.importorskip("transformers", reason="needs the train extra")
VLLM_PYTHON = default_vllm_python()
if not VLLM_PYTHON:
    pytest.skip("no vLLM environment (make install-vllm)", allow_module_level=True)

from tests.tiny_hf import build_vllm_model

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny-vllm"
N_CTX = 4096
# vLLM's own settings reach its worker; a secret named like one does not.
# VLLM_CPU_KVCACHE_SPACE (GiB) would size vLLM's KV cache on the CPU build:
# the fit's exact budget must still be the one vLLM uses.
VLLM_ENV = {"VLLM_NO_USAGE_STATS": "1", "VLLM_API_KEY": "sk-not-for-workers", "VLLM_CPU_KVCACHE_SPACE": "1"}


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    models = short_tempdir("gvl")
    build_vllm_model(models / MODEL, max_position_embeddings=N_CTX)
    env = {"GPUVISOR_VLLM_PYTHON": VLLM_PYTHON, "GPUVISOR_PARALLEL": "2", "GPUVISOR_N_CTX": str(N_CTX),
           **VLLM_ENV}
    with running(Server(models, env=env, model=MODEL)) as server:
        r = httpx.post(f"{server.base_url}/api/models/{MODEL}/load", timeout=300)
        assert r.status_code == 200, r.text
        _ready(server)
        yield server


def _ready(srv: Server) -> dict[str, Any]:
    return srv.wait_worker(lambda w: w["state"] == "ready", MODEL, timeout=240)


def _tree(pid: int) -> list[psutil.Process]:
    """The worker and every process it started (vLLM's engine core among them)."""
    worker = psutil.Process(pid)
    tree = [worker, *worker.children(recursive=True)]
    assert any("EngineCore" in p.name() for p in tree[1:]), tree
    return tree


def _group(pgid: int) -> list[int]:
    """Live (not zombie) processes in process group ``pgid``."""
    found = []
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except (ProcessLookupError, psutil.Error):
            continue  # gone meanwhile
    return found


def _stream(srv: Server, max_tokens: int, out: dict[str, Any]) -> None:
    """Stream a chat into ``out``: its data events, and ``started`` set at the fifth."""
    events: list[dict[str, Any]] = []
    body = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": max_tokens, "ignore_eos": True, "messages": [{"role": "user", "content": "Tell me about fish"}]}
    with httpx.stream("POST", srv.base_url + "/v1/chat/completions", json=body, timeout=120) as resp:
        out["status"] = resp.status_code
        for line in resp.iter_lines():
            if line == "data: [DONE]":
                out["done"] = True
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if len(events) == 5:
                    out["started"].set()
    out["events"] = events


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    pairs = (entry.decode(errors="replace").partition("=") for entry in raw.split(b"\0") if entry)
    return {k: v for k, _, v in pairs}


def test_vllm_settings_reach_the_worker(srv: Server) -> None:
    env = _environ(int(_ready(srv)["pid"]))
    assert env.get("VLLM_NO_USAGE_STATS") == "1"
    assert "VLLM_API_KEY" not in env and VLLM_ENV["VLLM_API_KEY"] not in env.values()


def test_the_fits_kv_budget_wins_over_vllms_own_setting(srv: Server) -> None:
    _ready(srv)
    assert _environ(int(srv.worker(MODEL)["pid"])).get("VLLM_CPU_KVCACHE_SPACE") == "1"
    fit = httpx.get(f"{srv.base_url}/api/models/{MODEL}", timeout=10).json()["fit"]
    # 1 KiB a token, 2 sequences, and the page of 128 tokens vLLM's block pool holds back.
    assert fit["kv_bytes"] == (N_CTX * 2 + 128) * 1024, fit
    log = httpx.get(f"{srv.base_url}/api/models/{MODEL}/log", timeout=10).text
    found = re.findall(r"KV cache size: ([\d,]+) tokens", log)
    # 1 GiB would be 1,048,576 tokens of this model.
    assert found and int(found[-1].replace(",", "")) == N_CTX * 2 + 128, log[-2000:]


def test_a_job_drains_and_evicts_the_vllm_worker(srv: Server) -> None:
    worker = _ready(srv)
    tree = _tree(int(worker["pid"]))
    out: dict[str, Any] = {"started": threading.Event()}
    streamer = threading.Thread(target=_stream, args=(srv, 300, out))
    streamer.start()
    assert out["started"].wait(60)
    job = submit(srv, "sleep", {"steps": 40, "step_seconds": 0.05})
    # The stream in flight ends whole before the job takes the device.
    wait_job(srv, job["id"], lambda j: j["status"] == "running" and j["pid"], timeout=120)
    streamer.join(60)
    assert out.get("done") and not any("error" in e for e in out["events"]), out.get("events", [])[-3:]
    assert out["events"][-1]["usage"]["completion_tokens"] == 300
    # The worker and vLLM's engine processes are gone while the job holds the device.
    _gone, alive = psutil.wait_procs(tree, timeout=30)
    assert not alive, alive
    refused = chat(srv, MODEL)
    assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1, refused.text
    assert refused.json()["error"]["code"] == "gpu_busy" and job["id"] in refused.json()["error"]["message"]
    wait_job(srv, job["id"], lambda j: j["status"] == "succeeded")
    answered = chat(srv, MODEL)  # loads the model again, on demand
    assert answered.status_code == 200, answered.text
    assert answered.json()["usage"]["completion_tokens"] == 4
    assert int(_ready(srv)["pid"]) != worker["pid"]


def test_a_sigkill_mid_stream_ends_the_stream_cleanly_and_restarts(srv: Server) -> None:
    worker = _ready(srv)
    pid = int(worker["pid"])
    pgid = os.getpgid(pid)
    tree = _tree(pid)
    workers = srv.workers()
    out: dict[str, Any] = {"started": threading.Event()}
    streamer = threading.Thread(target=_stream, args=(srv, N_CTX - 100, out))
    streamer.start()
    assert out["started"].wait(60)
    os.kill(pid, signal.SIGKILL)
    streamer.join(60)
    # The client's stream ends with an error object and the stream's usual end.
    assert out["status"] == 200 and out.get("done"), out
    assert out["events"][-1].get("error", {}).get("code") == "worker_crashed", (
        f"killed {pid}; workers before: {workers}; now: {srv.workers()}; last events: "
        + json.dumps(out["events"][-3:]))
    # No vLLM engine process outlives its worker: the whole group is gone.
    _gone, alive = psutil.wait_procs(tree, timeout=30)
    assert not alive and not _group(pgid), (alive, _group(pgid))
    restarted = srv.wait_worker(lambda w: w["state"] == "ready" and w["pid"] != pid, MODEL, timeout=240)
    assert restarted["restarts"] == worker["restarts"] + 1
    answered = chat(srv, MODEL)
    assert answered.status_code == 200, answered.text
    assert answered.json()["usage"]["completion_tokens"] == 4
