"""Opening an event stream: accept, commit the 200, keep alive until events flow.

A stream's 200 is committed only once the first event is in (or the request
is accepted), so a rejection is still an HTTP error. A prefill longer than the
keepalive interval commits anyway, and keepalive comments fill each silence
that long, so a proxy's read timeout does not cut a request with a long
prompt. Chat (``/v1/chat/completions``, ``/v1/completions``) and Responses
(``/v1/responses``) both open their streams here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from aiohttp import web

from supervisor.api.io import SseWriter

T = TypeVar("T")


class Keepalive:
    """Keepalive comments on ``sse`` whenever it has been silent ``interval`` s."""

    def __init__(self, sse: SseWriter, interval: float) -> None:
        self.sse = sse
        self.interval = interval
        self.last = time.monotonic()

    def wrote(self) -> None:
        """The stream just wrote an event: the silence starts again."""
        self.last = time.monotonic()

    async def run(self) -> None:
        """Tick until cancelled; a failed write (the client left) ends it by raising."""
        # Writes from this task and the handler cannot interleave inside a frame:
        # each frame is one write() call, and aiohttp shares one drain waiter.
        while True:
            await asyncio.sleep(max(0.0, self.last + self.interval - time.monotonic()))
            if time.monotonic() - self.last >= self.interval:
                await self.sse.comment("keepalive")
                self.wrote()

    async def until(self, done: asyncio.Future[Any]) -> None:
        """Keep alive while ``done`` is pending; raises if a keepalive cannot be written."""
        ticker = asyncio.create_task(self.run(), name="sse-keepalive")
        try:
            await asyncio.wait({done, ticker}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ticker.cancel()
            await asyncio.wait({ticker})
        failed = None if ticker.cancelled() else ticker.exception()
        if failed is not None:
            raise failed


async def open_stream(request: web.Request, first: Awaitable[T],
                      keepalive_s: float) -> tuple[SseWriter, asyncio.Future[T]]:
    """Commit to a 200 once ``first`` is in, and keep alive until then.

    ``first`` failing within ``keepalive_s`` raises here, before the 200: an
    HTTP error. Later, its failure is the caller's to write as the stream's
    own error (``result()`` of the returned future raises it)."""
    ready = asyncio.ensure_future(first)
    try:
        if not (await asyncio.wait({ready}, timeout=keepalive_s))[0]:
            sse = await SseWriter.start(request)
            await Keepalive(sse, keepalive_s).until(ready)
        else:
            ready.result()  # a rejection raises here, before the 200
            sse = await SseWriter.start(request)
    finally:
        ready.cancel()  # only still running when the client left: withdraws the request
    return sse, ready
