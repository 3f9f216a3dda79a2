"""A loopback reverse proxy that can hold a streamed answer half-way.

A browser test that checks an answer is drawn while it streams cannot rely
on timing: on a busy machine the whole stream may arrive in one read. Behind
this proxy the test decides: the stream stops after the first event carrying
``hold_after``, and goes on only when the test calls ``release()``, so the
partial answer is a state the page must show, not a race.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import aiohttp
from aiohttp import web

# Hop-by-hop headers (RFC 9110 section 7.6.1) and ones aiohttp sets itself.
_DROP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "host",
                   "content-encoding", "upgrade", "te", "trailer", "proxy-connection"})


class GateProxy:
    def __init__(self, upstream: str, hold_after: bytes) -> None:
        self.upstream = upstream.rstrip("/")
        self.hold_after = hold_after
        self.held = threading.Event()  # set once a stream is waiting at the gate
        self._open = threading.Event()
        self.port = 0
        self.session: aiohttp.ClientSession | None = None

    def release(self) -> None:
        self._open.set()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP}
        body = await request.read()
        assert self.session is not None
        async with self.session.request(request.method, self.upstream + request.path_qs, headers=headers,
                                   data=body or None, allow_redirects=False) as up:
            resp = web.StreamResponse(status=up.status, headers={
                k: v for k, v in up.headers.items() if k.lower() not in _DROP})
            await resp.prepare(request)
            gated = "text/event-stream" in up.headers.get("Content-Type", "")
            pending = b""
            async for chunk in up.content.iter_any():
                if not gated or self._open.is_set():
                    await resp.write(chunk)
                    continue
                # Cut at the end of the event (a blank line) that carries the mark.
                pending += chunk
                mark = pending.find(self.hold_after)
                end = pending.find(b"\n\n", mark) if mark >= 0 else -1
                if end < 0:
                    continue
                await resp.write(pending[: end + 2])
                self.held.set()
                await asyncio.to_thread(self._open.wait)
                await resp.write(pending[end + 2:])
            if gated and not self._open.is_set() and pending:
                await resp.write(pending)  # the mark never came: pass it all on
            await resp.write_eof()
            return resp


@contextmanager
def gate_proxy(upstream: str, hold_after: bytes) -> Iterator[GateProxy]:
    """Run a GateProxy on 127.0.0.1 (its own loop, in a thread) for the block."""
    gate = GateProxy(upstream, hold_after)
    loop = asyncio.new_event_loop()
    runner_box: list[web.AppRunner] = []

    async def start() -> None:
        app = web.Application(client_max_size=64 << 20)
        gate.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        app.router.add_route("*", "/{tail:.*}", gate._forward)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        gate.port = int(runner.addresses[0][1])
        runner_box.append(runner)

    async def stop() -> None:
        runner = runner_box[0]
        if gate.session is not None:
            await gate.session.close()
        await runner.cleanup()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield gate
    finally:
        gate.release()  # never leave a stream parked at the gate
        asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
