"""JSON over HTTP/1.1 on a Unix socket: how we reach the engine's own listener.

The engine (xllamacpp's embedded llama.cpp server) serves its extra endpoints
(``/tokenize``, ``/v1/models``) only over HTTP. Its listener is bound to a
private Unix socket, never to TCP, so nothing outside this process tree can
reach it.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
from collections.abc import Generator
from pathlib import Path
from typing import Any


class EngineHTTPError(Exception):
    """The engine answered with a non-2xx status."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"engine answered {status}: {body[:500]}")
        self.status = status


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


class UnixJSONClient:
    """One keep-alive connection per thread to the engine's Unix socket."""

    def __init__(self, path: Path, timeout: float = 60.0) -> None:
        self._path = str(path)
        self._timeout = timeout
        self._local = threading.local()

    def _conn(self) -> _UnixConnection:
        conn: _UnixConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = _UnixConnection(self._path, self._timeout)
            self._local.conn = conn
        return conn

    def request(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        # Every request sent here is idempotent (props, models, tokenize), so
        # one that fails on a kept-alive connection the engine has closed
        # since (it drops idle ones after seconds) is sent once more on a
        # new connection; one that fails on a new connection is an error.
        for attempt in range(2):
            reused = getattr(self._local, "conn", None) is not None
            conn = self._conn()
            try:
                conn.request(method, path, data, headers)
                resp = conn.getresponse()
                raw = resp.read()
                break
            except (OSError, http.client.HTTPException):
                conn.close()
                self._local.conn = None
                if not reused or attempt:
                    raise
        if not 200 <= resp.status < 300:
            raise EngineHTTPError(resp.status, raw.decode("utf-8", "replace"))
        return json.loads(raw)

    def stream(self, path: str, body: Any, timeout: float = 600.0) -> Generator[dict[str, Any], None, None]:
        """POST ``body`` and yield each server-sent event's JSON, on a
        connection of its own: closing the generator early closes it, and the
        engine stops that generation at its next write."""
        conn = _UnixConnection(self._path, timeout)
        try:
            conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if not 200 <= resp.status < 300:
                raw = resp.read().decode("utf-8", "replace")
                try:
                    refusal = json.loads(raw)
                except json.JSONDecodeError:
                    raise EngineHTTPError(resp.status, raw) from None
                if not isinstance(refusal, dict) or "error" not in refusal:
                    raise EngineHTTPError(resp.status, raw)
                yield refusal
                return
            while line := resp.readline():
                # Events are "data: {json}"; a failure mid-stream may come
                # as "error: {json}".
                kind, _, payload = line.partition(b": ")
                if kind not in (b"data", b"error") or not payload.strip().startswith(b"{"):
                    continue
                event = json.loads(payload)
                if kind == b"error" and "error" not in event:
                    event = {"error": event}
                yield event
        finally:
            conn.close()

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        out = self.request("POST", "/tokenize",
                           {"content": text, "add_special": add_special, "parse_special": parse_special})
        return [int(t) for t in out["tokens"]]
