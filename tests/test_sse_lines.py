"""An event's data stays on one line for every reader: a model can emit NEL,
LINE SEPARATOR or PARAGRAPH SEPARATOR, which JSON leaves raw and Python's
splitlines() (httpx's iter_lines) takes for line ends. Found when a tiny
model's stream broke a client reading it with iter_lines."""

from __future__ import annotations

import json

import httpx
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from supervisor.api.io import SseWriter

TRICKY = "a\u0085b\u2028c\u2029d\x1ce\nf"


async def test_line_breaking_characters_are_escaped_in_event_data() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        sse = await SseWriter.start(request)
        await sse.data({"text": TRICKY}, event="delta")
        await sse.data(json.dumps({"text": TRICKY}, ensure_ascii=False).encode(), event="stored")
        await sse.close()
        return sse.response

    app = web.Application()
    app.router.add_get("/", handler)
    async with TestClient(TestServer(app)) as client:
        body = await (await client.get("/")).read()
    for raw in ("\u0085", "\u2028", "\u2029"):
        assert raw.encode() not in body
    # Read as httpx's iter_lines reads a stream: every data line parses whole.
    lines = list(httpx.Response(200, content=body).iter_lines())
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert data == [{"text": TRICKY}, {"text": TRICKY}]
