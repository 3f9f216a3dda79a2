"""A background response on a disk that fills up: acknowledged, it still ends.

The database lives on a small tmpfs that the test fills while the response
generates (real SQLite, a real full disk): first in-process with the scripted
pool of ``tests/responses_fake.py`` (exact timing, a restart), then the real
service with the tiny model. Whatever the disk refused is stored once it has
space again: every acknowledged response reaches a terminal status and its
replay ends with its terminal event. Needs root (it mounts a tmpfs).
"""

from __future__ import annotations

import asyncio
import functools
import json
import shutil
import signal
import sqlite3
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import openai
import pytest
from aiohttp.test_utils import TestServer
from openai.types.responses import Response

from supervisor.appkeys import RESPONSES
from tests.responses_fake import MODEL, FakePool
from tests.server import Server, poll_until, short_tempdir
from tests.test_faults import Tmpfs, small_disk  # noqa: F401 - fixture
from tests.test_responses_api import build_app, check_sequence, serve
from worker.protocol import Delta, Done

pytestmark = pytest.mark.timeout(60)

# Coarse bounds against hangs: storing retries every few seconds at most.
SETTLE_S = 15.0
WORDS = [f" w{i}" for i in range(60)]
TERMINAL = ("response.completed", "response.incomplete", "response.failed")


@dataclass
class Running:
    pool: FakePool
    url: str
    db_path: Path
    client: openai.AsyncOpenAI
    server: TestServer

    async def restart(self) -> None:
        """Shut the service down (as SIGTERM does) and start it again on the same database."""
        await self.client.close()
        await self.server.close()
        self.server = await serve(build_app(self.pool, self.db_path, keepalive_s=10))
        self.url = f"http://127.0.0.1:{self.server.port}"
        self.client = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
async def on_small_disk(small_disk: Callable[[str], Tmpfs]) -> AsyncIterator[tuple[Running, Tmpfs]]:
    disk = small_disk("4m")
    pool = FakePool()
    db_path = disk.path / "gv.db"
    server = await serve(build_app(pool, db_path, keepalive_s=10))
    url = f"http://127.0.0.1:{server.port}"
    running = Running(pool, url, db_path, openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused",
                                                             max_retries=0), server)
    try:
        yield running, disk
    finally:
        await running.client.close()
        await running.server.close()


async def replay(url: str, rid: str, after: int = -1) -> list[dict[str, Any]]:
    """``GET /v1/responses/{rid}?stream=true``: every event it sends, until the stream ends."""
    events = []
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{url}/v1/responses/{rid}", params={"stream": "true", "starting_after": str(after)},
                    timeout=aiohttp.ClientTimeout(total=SETTLE_S)) as resp,
    ):
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: "):
                events.append(json.loads(line[6:]))
    return events


async def status_of(client: openai.AsyncOpenAI, rid: str, until: Callable[[str], bool]) -> Response:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE_S
    while True:
        resp = await client.responses.retrieve(rid)
        if until(resp.status or "") or loop.time() > deadline:
            return resp
        await asyncio.sleep(0.05)


def stored_events(db_path: Path, rid: str) -> int:
    with sqlite3.connect(f"file:{db_path}?mode=ro", uri=True) as db:
        return int(db.execute("SELECT COUNT(*) FROM response_events WHERE response_id = ?", (rid,)).fetchone()[0])


async def start_filling(run: Running, disk: Tmpfs) -> tuple[str, Path]:
    """A background response that generates slowly; the disk fills once it runs."""
    run.pool.script = [Delta(0, "start", 1), 0.1]
    for word in WORDS:
        run.pool.script += [Delta(0, word, 1), 0.02]
    run.pool.script.append(Done(0, "stop", 3, len(WORDS) + 1))
    created = await run.client.responses.create(model=MODEL, input="x", background=True)
    assert created.status == "queued"
    assert (await status_of(run.client, created.id, lambda s: s == "in_progress")).status == "in_progress"
    return created.id, disk.fill(leave_bytes=0)


def terminal(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The replay's last event: the replay is gapless, in the documented order, with one terminal event."""
    assert [e["type"] for e in events[:2]] == ["response.created", "response.queued"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    # check_sequence knows the foreground order: the same without response.queued.
    check_sequence([{**e, "sequence_number": i} for i, e in enumerate([events[0], *events[2:]])])
    return events[-1]


async def test_response_completes_in_memory_and_is_stored_once_space_returns(
        on_small_disk: tuple[Running, Tmpfs]) -> None:
    run, disk = on_small_disk
    rid, filler = await start_filling(run, disk)
    # A client following it live gets to its end although the disk refuses every write.
    live = await asyncio.wait_for(replay(run.url, rid), SETTLE_S)
    end = terminal(live)
    assert end["type"] == "response.completed"
    assert end["response"]["output"][0]["content"][0]["text"] == "start" + "".join(WORDS)
    assert stored_events(run.db_path, rid) < len(live), "the disk never refused a write"
    # Nothing of its end is stored yet: it is still running as far as the database knows.
    assert (await run.client.responses.retrieve(rid)).status == "in_progress"
    with pytest.raises(openai.ConflictError):
        await run.client.responses.cancel(rid)
    # A delete the disk refuses changes nothing: the response still ends.
    with pytest.raises(openai.APIStatusError) as refused:
        await run.client.responses.delete(rid)
    assert refused.value.status_code == 507
    filler.unlink()
    final = await status_of(run.client, rid, lambda s: s != "in_progress")
    assert final.status == "completed", final
    assert final.output_text == "start" + "".join(WORDS)
    stored = await replay(run.url, rid)
    assert stored == live
    assert stored_events(run.db_path, rid) == len(live)


async def test_disk_refusing_past_the_bound_stops_it_failed(on_small_disk: tuple[Running, Tmpfs]) -> None:
    run, disk = on_small_disk
    run.server.app[RESPONSES].service.live.max_unstored_bytes = 2000
    rid, filler = await start_filling(run, disk)
    live = await asyncio.wait_for(replay(run.url, rid), SETTLE_S)
    end = terminal(live)
    assert end["type"] == "response.failed"
    assert end["response"]["error"]["cause"] == "storage_full", end
    assert "disk" in end["response"]["error"]["message"]
    # The generation was stopped, well before all its words.
    assert run.pool.closed == 1
    assert len(end["response"]["output"][0]["content"][0]["text"]) < len("start" + "".join(WORDS))
    filler.unlink()
    final = await status_of(run.client, rid, lambda s: s != "in_progress")
    assert final.status == "failed" and final.error is not None
    assert final.error.model_dump()["cause"] == "storage_full"
    assert await replay(run.url, rid) == live


async def test_restart_while_its_end_waits_for_the_disk(on_small_disk: tuple[Running, Tmpfs]) -> None:
    run, disk = on_small_disk
    rid, filler = await start_filling(run, disk)
    live = await asyncio.wait_for(replay(run.url, rid), SETTLE_S)
    assert live[-1]["type"] == "response.completed"
    # Restarted with the disk still full: the start does not fail, and the
    # response is marked interrupted once the disk has space.
    await run.restart()
    assert (await run.client.responses.retrieve(rid)).status == "in_progress"
    filler.unlink()
    final = await status_of(run.client, rid, lambda s: s != "in_progress")
    assert final.status == "failed" and final.error is not None, final
    assert final.error.model_dump()["cause"] == "interrupted"
    stored = await replay(run.url, rid)
    assert stored[-1]["type"] == "response.failed"
    assert [e["sequence_number"] for e in stored] == list(range(len(stored)))
    assert sum(e["type"] in ("response.completed", "response.failed") for e in stored) == 1
    # Served as usual after it.
    run.pool.say("again")
    assert (await run.client.responses.create(model=MODEL, input="y")).output_text == "again"


# ------------------------------------------------------ the real service


def _sse_events(client: httpx.Client, rid: str) -> list[dict[str, Any]]:
    events = []
    with client.stream("GET", f"/v1/responses/{rid}", params={"stream": "true"}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    return events


def _retrieve(client: httpx.Client, rid: str) -> dict[str, Any]:
    body: dict[str, Any] = client.get(f"/v1/responses/{rid}").json()
    return body


def test_service_on_a_full_disk_ends_every_acknowledged_background_response(
        tiny_model_path: Path, small_disk: Callable[[str], Tmpfs]) -> None:
    disk = small_disk("16m")
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    # Room for 1,000 tokens each: about half a second of generation (more on a busy machine),
    # long enough to fill the disk meanwhile.
    srv = Server(models, state_dir=disk.path, env={"GPUVISOR_N_CTX": "4096"})
    # The server log stays off the full disk: it is the evidence.
    logs = short_tempdir("gvlog")
    srv.log_path = logs / "server.log"
    try:
        srv.start()
        body = {"model": srv.model, "input": "go", "background": True, "max_output_tokens": 1000,
                "ignore_eos": True, "temperature": 0}
        with httpx.Client(base_url=srv.base_url, timeout=SETTLE_S) as client:
            created = [client.post("/v1/responses", json=body) for _ in range(3)]
            assert [r.status_code for r in created] == [200] * 3, [r.text for r in created]
            filler = disk.fill(leave_bytes=0)
            more = [client.post("/v1/responses", json=body) for _ in range(3)]
            assert all(r.status_code in (200, 507) for r in more), [r.text for r in more]
            acknowledged = [r.json()["id"] for r in created + more if r.status_code == 200]
            # Followed live, each one ends, although the disk refuses its events.
            live = {rid: _sse_events(client, rid) for rid in acknowledged}
            for events in live.values():
                assert events[-1]["type"] in TERMINAL, events[-1]
            assert "the disk is full" in srv.log_text(), "the disk never refused a write"
            filler.unlink()
            for rid in acknowledged:
                final = poll_until(functools.partial(_retrieve, client, rid),
                                   lambda r: r["status"] not in ("queued", "in_progress"), timeout=SETTLE_S)
                assert final["status"] == "incomplete", final  # cut at max_output_tokens, as asked
                assert _sse_events(client, rid) == live[rid]
                assert [e["sequence_number"] for e in live[rid]] == list(range(len(live[rid])))
        with sqlite3.connect(disk.path / "gpuvisor.db") as db:
            assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        srv.stop(signal.SIGKILL)
        shutil.rmtree(logs, ignore_errors=True)
        shutil.rmtree(models, ignore_errors=True)
