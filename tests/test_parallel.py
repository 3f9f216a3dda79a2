"""Parallel requests per model: the engine's slots, as a client sees them."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.models.demo import write_tiny_gguf
from tests.server import Server, short_tempdir

pytestmark = pytest.mark.timeout(180)


def _models(tiny_model_path: Path) -> Path:
    models = short_tempdir("gvp")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    return models


def _body(model: str, max_tokens: int, stream: bool, content: str = "go on") -> dict[str, Any]:
    return {"model": model, "stream": stream, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "messages": [{"role": "user", "content": content}]}


async def _stream_until(c: httpx.AsyncClient, url: str, body: dict[str, Any],
                        first: asyncio.Event, events: list[dict[str, Any]]) -> float:
    """Read a whole SSE stream; set ``first`` at its first chunk; return its end time."""
    async with c.stream("POST", url, json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
                first.set()
    return asyncio.get_running_loop().time()


@pytest.fixture
def server2(tiny_model_path: Path, start_server: Callable[..., Server]) -> Server:
    return start_server(_models(tiny_model_path), env={"GPUVISOR_N_CTX": "16384", "GPUVISOR_PARALLEL": "2"})


def test_a_short_request_is_not_stuck_behind_a_long_stream(server2: Server) -> None:
    srv = server2
    url = srv.base_url + "/v1/chat/completions"

    async def run() -> tuple[float, float, dict[str, Any]]:
        async with httpx.AsyncClient(timeout=120) as c:
            first, events = asyncio.Event(), []
            long = asyncio.create_task(_stream_until(c, url, _body(srv.model, 12000, True), first, events))
            await asyncio.wait_for(first.wait(), 60)
            short = await c.post(url, json=_body(srv.model, 8, False, "hi"))
            short_end = asyncio.get_running_loop().time()
            assert short.status_code == 200, short.text
            workers = (await c.get(srv.base_url + "/api/workers")).json()["workers"]
            return short_end, await long, {"short": short.json(), "worker": workers[0], "long": events}

    short_end, long_end, seen = asyncio.run(run())
    assert seen["short"]["usage"]["completion_tokens"] == 8
    assert short_end < long_end, "the short request waited for the long stream"
    assert seen["worker"]["parallel"] == 2
    assert seen["long"][-1]["choices"] == [] or seen["long"][-1]["choices"][0]["finish_reason"] == "length"


def test_greedy_output_is_the_same_alone_and_side_by_side(server2: Server) -> None:
    """Batching two requests in one engine step must not change either answer."""
    srv = server2
    url = srv.base_url + "/v1/completions"
    prompts = ["the tiny model is", "hello world and"]

    def body(prompt: str) -> dict[str, Any]:
        return {"model": srv.model, "prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True}

    alone = [httpx.post(url, json=body(p), timeout=60).json()["choices"][0]["text"] for p in prompts]

    async def together() -> list[str]:
        async with httpx.AsyncClient(timeout=60) as c:
            outs = await asyncio.gather(*(c.post(url, json=body(p)) for p in prompts))
            return [r.json()["choices"][0]["text"] for r in outs]

    assert asyncio.run(together()) == alone


def test_a_crash_ends_every_stream_in_flight_and_queued_requests_wait(tiny_model_path: Path,
                                                                      start_server: Callable[..., Server]) -> None:
    srv = start_server(_models(tiny_model_path), env={
        "GPUVISOR_N_CTX": "16384", "GPUVISOR_PARALLEL": "2", "GPUVISOR_PING_INTERVAL": "0.5"})
    url = srv.base_url + "/v1/chat/completions"
    pid = srv.worker()["pid"]

    async def run() -> tuple[list[list[dict[str, Any]]], httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as c:
            firsts = [asyncio.Event(), asyncio.Event()]
            events: list[list[dict[str, Any]]] = [[], []]
            streams = [asyncio.create_task(_stream_until(c, url, _body(srv.model, 15000, True), firsts[i],
                                                         events[i])) for i in range(2)]
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 60)
            queued = asyncio.create_task(c.post(url, json=_body(srv.model, 4, False, "hi")))
            while (await c.get(srv.base_url + "/api/workers")).json()["workers"][0]["queued"] < 1:
                await asyncio.sleep(0.02)
            os.kill(pid, signal.SIGKILL)
            await asyncio.wait_for(asyncio.gather(*streams), 30)
            return events, await asyncio.wait_for(queued, 60)

    events, queued = asyncio.run(run())
    for stream in events:
        assert stream[-1]["error"]["code"] == "worker_crashed", stream[-1]
    assert queued.status_code == 200, queued.text
    assert queued.json()["usage"]["completion_tokens"] == 4
    assert srv.worker()["pid"] != pid


def test_closing_a_stream_frees_its_slot_for_the_queued_request(tiny_model_path: Path,
                                                               start_server: Callable[..., Server]) -> None:
    srv = start_server(_models(tiny_model_path), env={"GPUVISOR_N_CTX": "16384", "GPUVISOR_PARALLEL": "1"})
    url = srv.base_url + "/v1/chat/completions"

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(timeout=120) as c:
            async with c.stream("POST", url, json=_body(srv.model, 15000, True)) as first:
                lines = first.aiter_lines()
                await anext(lines)
                queued = asyncio.create_task(c.post(url, json=_body(srv.model, 4, False, "hi")))
                while (await c.get(srv.base_url + "/api/workers")).json()["workers"][0]["queued"] < 1:
                    await asyncio.sleep(0.02)
            return await asyncio.wait_for(queued, 60)

    answer = asyncio.run(run())
    assert answer.status_code == 200, answer.text
    worker = srv.wait_worker(lambda w: bool(w["stats"]) and w["stats"]["requests_done"] >= 1, timeout=20)
    # The queued request ran long before 15,000 tokens could have been made.
    assert worker["stats"]["tokens_generated"] < 15000
    assert worker["stats"]["requests_cancelled"] >= 1


def test_embeddings_in_parallel_equal_one_at_a_time(tiny_model_path: Path,
                                                    start_server: Callable[..., Server]) -> None:
    srv = start_server(_models(tiny_model_path), env={"GPUVISOR_PARALLEL": "2"})
    url = srv.base_url + "/v1/embeddings"
    texts = ["hello world", "tiny model", "the lab gpu", "a data job"]
    alone = [httpx.post(url, json={"model": srv.model, "input": t}, timeout=60).json()["data"][0]["embedding"]
             for t in texts]
    batched = httpx.post(url, json={"model": srv.model, "input": texts}, timeout=60).json()["data"]

    async def together() -> list[list[float]]:
        async with httpx.AsyncClient(timeout=60) as c:
            outs = await asyncio.gather(*(c.post(url, json={"model": srv.model, "input": t}) for t in texts))
            return [r.json()["data"][0]["embedding"] for r in outs]

    concurrent = asyncio.run(together())
    for i, vec in enumerate(alone):
        assert batched[i]["embedding"] == pytest.approx(vec, abs=1e-5)
        assert concurrent[i] == pytest.approx(vec, abs=1e-5)
    workers = httpx.get(srv.base_url + "/api/workers").json()["workers"]
    assert [w["parallel"] for w in workers if w["mode"] == "embedding"] == [2]


@pytest.fixture(scope="module")
def slow_prefill_model() -> Path:
    """Big enough that a 6,000-token prompt (2,000 words) takes seconds to prefill on a CPU."""
    models = short_tempdir("gvs")
    write_tiny_gguf(models / "mid.gguf", n_embd=256, n_layer=4, n_head=4, n_head_kv=2, n_ff=512,
                    n_ctx=8192, name="mid")
    return models


def _prompt(words: int, salt: str) -> str:
    # About three tokens per word: the tiny vocab spells words out in bytes.
    return salt + " " + " ".join(["the", "a", "is", "of", "and", "to", "in", "it"] * (words // 8))


def test_a_cancel_during_a_long_prefill_frees_the_slot_early(slow_prefill_model: Path,
                                                            start_server: Callable[..., Server]) -> None:
    """The engine reports prefill progress once per 512-token batch, and a
    cancel is honoured there: the slot frees long before the prefill would end."""
    srv = start_server(slow_prefill_model, env={"GPUVISOR_N_CTX": "8192", "GPUVISOR_PARALLEL": "1",
                                                "GPUVISOR_N_THREADS": "1"})
    url = srv.base_url + "/v1/completions"

    def body(prompt: str, max_tokens: int = 1) -> dict[str, Any]:
        return {"model": "mid", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}

    async def run() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        async with httpx.AsyncClient(timeout=120) as c:
            t0 = loop.time()
            full = await c.post(url, json=body(_prompt(2000, "yes")))
            assert full.status_code == 200, full.text
            full_s = loop.time() - t0
            # Same length, another first word: nothing of it is cached.
            doomed = asyncio.create_task(c.post(url, json=body(_prompt(2000, "no"))))
            while not (await c.get(srv.base_url + "/api/workers")).json()["workers"][0]["in_flight"]:
                await asyncio.sleep(0.01)
            await asyncio.sleep(min(0.3, full_s / 10))
            doomed.cancel()
            await asyncio.gather(doomed, return_exceptions=True)
            t1 = loop.time()
            after = await c.post(url, json=body("hello", 4))
            assert after.status_code == 200, after.text
            return full_s, loop.time() - t1

    full_s, after_s = asyncio.run(run())
    assert full_s > 1.0, f"the prefill was too fast to test a cancel in it ({full_s:.2f} s)"
    # Without the cancel the short request would wait out most of a whole prefill.
    assert after_s < 0.6 * full_s, (after_s, full_s)


def test_many_embeddings_in_one_request_are_answered(tiny_model_path: Path,
                                                     start_server: Callable[..., Server]) -> None:
    """Replies go in batches under the IPC frame limit; past OpenAI's 2,048
    inputs the request is a 400, and embeddings keep working after either."""
    srv = start_server(_models(tiny_model_path))
    url = srv.base_url + "/v1/embeddings"
    texts = [f"w{i} the" for i in range(300)]
    r = httpx.post(url, json={"model": srv.model, "input": texts}, timeout=120)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["index"] for d in data] == list(range(300))
    one = httpx.post(url, json={"model": srv.model, "input": texts[123]}, timeout=60).json()["data"][0]
    assert data[123]["embedding"] == pytest.approx(one["embedding"], abs=1e-5)
    too_many = httpx.post(url, json={"model": srv.model, "input": ["x"] * 2049}, timeout=60)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "input"
    workers = httpx.get(srv.base_url + "/api/workers").json()["workers"]
    assert all(w["in_flight"] == 0 for w in workers)
