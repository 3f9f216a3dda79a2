"""Request decoding and response helpers shared by every route module."""

from __future__ import annotations

import asyncio
import json
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from supervisor.appkeys import CONFIG
from supervisor.errors import ApiError, BadRequest, PayloadTooLarge, RequestTimeout
from supervisor.errors import validation_param as validation_param  # noqa: PLC0414 - re-exported

T = TypeVar("T")

_json_encoder = msgspec.json.Encoder()


async def read_body(request: web.Request) -> bytes:
    """The raw body. aiohttp has already decoded gzip/deflate/br/zstd bodies
    (zstd through backports.zstd), counting the limit on the decoded size."""
    cfg = request.app[CONFIG]
    try:
        async with asyncio.timeout(cfg.body_timeout):
            return await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise PayloadTooLarge(f"request body exceeds the limit of {cfg.max_body_bytes} bytes") from exc
    except TimeoutError as exc:
        raise RequestTimeout(f"the request body did not arrive within {cfg.body_timeout:g} s") from exc


def decode_json(body: bytes, type_: type[T]) -> T:
    if not body.strip():
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid request: {exc}", param=validation_param(exc)) from exc
    except msgspec.DecodeError as exc:
        raise BadRequest(f"malformed JSON: {exc}", code="invalid_json") from exc
    except RecursionError as exc:
        # msgspec's guard against deeply nested input (stack exhaustion).
        raise BadRequest("JSON nested too deeply", code="invalid_json") from exc


async def decode_body(request: web.Request, type_: type[T]) -> T:
    return decode_json(await read_body(request), type_)


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=_json_encoder.encode(obj),
        status=status,
        content_type="application/json",
        headers=headers,
    )


def error_response(err: ApiError) -> web.Response:
    return json_response(err.body(), status=err.status, headers=err.headers)


async def answer_and_close(request: web.Request, resp: web.Response) -> web.Response:
    """Send ``resp``, then close the connection at once: aiohttp would
    otherwise linger up to 10 s reading the rest of a stalled body."""
    resp.force_close()
    await resp.prepare(request)
    await resp.write_eof()
    if request.protocol is not None:
        request.protocol.force_close()
    return resp


SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


# Characters JSON may carry raw that Python's str.splitlines() (and so
# httpx's iter_lines, which many clients read streams with) takes for line
# ends: NEL, LINE SEPARATOR, PARAGRAPH SEPARATOR. A model can emit any of
# them; escaped, an event's data stays on its one line for every reader.
_LINE_BREAKERS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def _line_safe(payload: bytes) -> bytes:
    # In UTF-8 these byte sequences are only ever these characters, and in
    # JSON only inside strings, where the escape means the same.
    for raw, escaped in _LINE_BREAKERS:
        if raw in payload:
            payload = payload.replace(raw, escaped)
    return payload


class SseWriter:
    """Writes Server-Sent Events onto a prepared StreamResponse."""

    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response

    @classmethod
    async def start(cls, request: web.Request, headers: dict[str, str] | None = None) -> SseWriter:
        resp = web.StreamResponse(status=200, headers={**SSE_HEADERS, **(headers or {})})
        await resp.prepare(request)
        return cls(resp)

    async def data(self, obj: Any, *, event: str | None = None, id: str | int | None = None) -> None:
        parts = []
        if id is not None:
            parts.append(b"id: %s\n" % str(id).encode())
        if event is not None:
            parts.append(b"event: %s\n" % event.encode())
        payload = obj if isinstance(obj, bytes) else _json_encoder.encode(obj)
        parts.append(b"data: " + _line_safe(payload) + b"\n\n")
        await self.response.write(b"".join(parts))

    async def raw(self, chunk: bytes) -> None:
        await self.response.write(chunk)

    async def comment(self, text: str = "keepalive") -> None:
        await self.response.write(b": " + text.encode() + b"\n\n")

    async def close(self) -> None:
        await self.response.write_eof()


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))
