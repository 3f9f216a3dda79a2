"""A vLLM worker under faults, through the real server: a client that goes
away while its long prompt is still being prefilled, or a background
response cancelled then, ends that request at vLLM's next prefill chunk, and
the worker serves the next request without waiting out the prefill; a request in flight during two crashes of vLLM's
engine core is refused from then on (400 ``request_crashed_worker``), as on
llama.cpp (tests/test_poison.py), and the model serves everybody else.

One worker for the module, with one sequence, so a request that was not
ended would hold the next one back. The model is larger than the other vLLM
tests' (4 layers, hidden 512) so that an 8,000-token prompt takes seconds to
prefill on a CPU. Needs the vLLM environment (``make install-vllm``) and the
train extra (the model is made with transformers)."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest

from supervisor.config import default_vllm_python
from tests.server import Server, running, short_tempdir

pytest.importorskip("transformers", reason="needs the train extra")
VLLM_PYTHON = default_vllm_python()
if not VLLM_PYTHON:
    pytest.skip("no vLLM environment (make install-vllm)", allow_module_level=True)

from tests.tiny_hf import build_vllm_model

# Each crash costs a vLLM start (30-60 s on a CPU, more on a busy machine).
pytestmark = pytest.mark.timeout(600)
MODEL = "mid-vllm"
N_CTX = 16384
START_S = 300


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    models = short_tempdir("gvf")
    build_vllm_model(models / MODEL, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                     num_attention_heads=8, max_position_embeddings=N_CTX)
    env = {"GPUVISOR_VLLM_PYTHON": VLLM_PYTHON, "GPUVISOR_PARALLEL": "1", "GPUVISOR_N_CTX": str(N_CTX),
           "GPUVISOR_CRASH_LIMIT": "3"}
    with running(Server(models, env=env, model=MODEL)) as server:
        r = httpx.post(f"{server.base_url}/api/models/{MODEL}/load", timeout=START_S)
        assert r.status_code == 200, r.text
        _ready(server)
        yield server


def _ready(srv: Server, pid: int | None = None) -> dict[str, Any]:
    return srv.wait_worker(lambda w: w["state"] == "ready" and w["pid"] != pid, MODEL, timeout=START_S)


def _prompt(words: int, salt: str) -> str:
    # About two tokens per word with the tiny byte-level vocab.
    return salt + " " + " ".join(["the", "a", "is", "of", "and", "to", "in", "it"] * (words // 8))


def _completion(prompt: str, max_tokens: int = 1, **more: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **more}


def _in_flight(workers: list[dict[str, Any]]) -> int:
    return sum(int(w["in_flight"]) for w in workers if w["model"] == MODEL)


def test_a_client_gone_during_a_long_prefill_ends_it_and_the_next_request_is_served(srv: Server) -> None:
    _ready(srv)
    url = srv.base_url + "/v1/completions"
    before = srv.worker(MODEL)["stats"] or {}

    async def run() -> tuple[float, int, float, float]:
        loop = asyncio.get_running_loop()
        async with httpx.AsyncClient(timeout=300) as c:
            warm = await c.post(url, json=_completion("hello", 4))
            assert warm.status_code == 200, warm.text
            t0 = loop.time()
            full = await c.post(url, json=_completion(_prompt(4000, "yes")))
            assert full.status_code == 200, full.text
            full_s = loop.time() - t0
            prompt_tokens = int(full.json()["usage"]["prompt_tokens"])
            # As long, another first word: none of it is in vLLM's prefix cache.
            doomed = asyncio.create_task(c.post(url, json=_completion(_prompt(4000, "no"))))
            while not _in_flight((await c.get(srv.base_url + "/api/workers")).json()["workers"]):
                await asyncio.sleep(0.01)
            await asyncio.sleep(min(0.5, full_s / 10))
            doomed.cancel()  # the client goes away: its connection closes
            await asyncio.gather(doomed, return_exceptions=True)
            t1 = loop.time()
            while _in_flight((await c.get(srv.base_url + "/api/workers")).json()["workers"]):
                await asyncio.sleep(0.01)
            ended_s = loop.time() - t1
            after = await c.post(url, json=_completion("hello", 4))
            assert after.status_code == 200, after.text
            assert after.json()["usage"]["completion_tokens"] == 4
            return full_s, prompt_tokens, ended_s, loop.time() - t1

    full_s, prompt_tokens, ended_s, after_s = asyncio.run(run())
    print(f"\nvLLM prefill of {prompt_tokens} tokens: {full_s:.2f} s; after a cancel in it the request ended "
          f"in {ended_s:.2f} s and the next one was answered in {after_s:.2f} s")
    assert prompt_tokens > 6000 and full_s > 1.0, f"too fast to test a cancel in it ({full_s:.2f} s)"
    # Without the cancel the next request would wait out most of the prefill.
    assert after_s < 0.6 * full_s, (after_s, full_s)
    # The worker's counters come with its heartbeats: wait for the last request's.
    stats = srv.wait_worker(lambda w: w["stats"]["tokens_generated"] - before.get("tokens_generated", 0) >= 9,
                            MODEL)["stats"]
    assert stats["requests_cancelled"] == before.get("requests_cancelled", 0) + 1, stats
    # The doomed request generated nothing: it never got past its prefill.
    assert stats["tokens_generated"] - before.get("tokens_generated", 0) == 4 + 1 + 4, stats


def test_a_background_response_cancelled_in_its_prefill_frees_the_worker(srv: Server) -> None:
    """The other way a request is cancelled: ``POST /v1/responses/{id}/cancel``
    on a background response whose long prompt is still being prefilled."""
    _ready(srv)
    before = srv.worker(MODEL)["stats"] or {}
    with httpx.Client(base_url=srv.base_url, timeout=300) as http:
        t0 = time.monotonic()
        full = http.post("/v1/completions", json=_completion(_prompt(4000, "maybe")))
        assert full.status_code == 200, full.text
        full_s = time.monotonic() - t0
        created = http.post("/v1/responses", json={"model": MODEL, "input": _prompt(4000, "never"),
                                                   "background": True, "max_output_tokens": 16})
        assert created.status_code == 200, created.text
        rid = created.json()["id"]
        while not _in_flight(http.get("/api/workers").json()["workers"]):
            time.sleep(0.01)
        time.sleep(min(0.5, full_s / 10))
        t1 = time.monotonic()
        cancelled = http.post(f"/v1/responses/{rid}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text
        after = http.post("/v1/completions", json=_completion("hello", 4))
        after_s = time.monotonic() - t1
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4, after.text
        assert http.get(f"/v1/responses/{rid}").json()["status"] == "cancelled"
    print(f"\nvLLM prefill: {full_s:.2f} s; after a background response was cancelled in its prefill "
          f"the next request was answered in {after_s:.2f} s")
    assert full_s > 1.0 and after_s < 0.6 * full_s, (after_s, full_s)
    stats = srv.wait_worker(lambda w: w["stats"]["tokens_generated"] - before.get("tokens_generated", 0) >= 5,
                            MODEL)["stats"]
    assert stats["requests_cancelled"] == before.get("requests_cancelled", 0) + 1, stats
    assert stats["tokens_generated"] - before.get("tokens_generated", 0) == 1 + 4, stats


def _engine_core(pid: int) -> psutil.Process:
    """vLLM's engine-core process, the worker's child that runs the model."""
    [core] = [p for p in psutil.Process(pid).children(recursive=True) if "EngineCore" in p.name()]
    return core


async def _crash_engine_during(srv: Server, body: dict[str, Any]) -> httpx.Response:
    """Send ``body``; once the worker has it, SIGKILL vLLM's engine core."""
    pid = int(_ready(srv)["pid"])
    core = _engine_core(pid)
    async with httpx.AsyncClient(base_url=srv.base_url, timeout=START_S) as c:
        task = asyncio.create_task(c.post("/v1/completions", json=body))
        while not _in_flight((await c.get("/api/workers")).json()["workers"]):
            # Answered without ever being in flight: say how, rather than wait for ever.
            assert not task.done(), (task.result().status_code, task.result().text)
            await asyncio.sleep(0.02)
        core.send_signal(signal.SIGKILL)
        resp = await task
    _ready(srv, pid)
    return resp


def test_a_request_in_flight_when_the_engine_died_twice_is_refused(srv: Server) -> None:
    restarts = int(_ready(srv)["restarts"])
    poison = _completion("the request that kills", N_CTX - 100, ignore_eos=True)
    for _ in range(2):
        r = asyncio.run(_crash_engine_during(srv, poison))
        assert r.status_code == 502 and r.json()["error"]["code"] == "worker_crashed", r.text
    with httpx.Client(base_url=srv.base_url, timeout=120) as http:
        # The same prompt again, other sampling: refused before it reaches the worker.
        r = http.post("/v1/completions", json={**poison, "max_tokens": 3, "temperature": 0.5})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "request_crashed_worker" and "twice" in err["message"], err
        other = http.post("/v1/completions", json=_completion("hello", 4))
        assert other.status_code == 200 and other.json()["usage"]["completion_tokens"] == 4, other.text
    # Two crashes, the repeat counted once: the model is not near its limit of 3.
    w = srv.worker(MODEL)
    assert w["state"] == "ready" and w["restarts"] == restarts + 2, w
    assert httpx.get(f"{srv.base_url}/api/models/{MODEL}", timeout=10).json()["state"] == "ready"
