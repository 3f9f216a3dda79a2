"""A stand-in for a SearXNG instance's JSON search API, on loopback, for
tests: ``GET /search?q=...&format=json`` answers twelve results (and two
whose URLs are not http), and records each query. ``mode`` makes it
misbehave: ``slow`` (answers after ``delay_s``), ``huge`` (a 2 MiB body),
``redirect`` (a 302 to ``/elsewhere``, which records that it was followed)
and ``html`` (a page, as an instance with format=json disabled answers)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

RESULTS = [{"url": f"https://site{i}.example.com/page/{i}", "title": f"Result {i}",
            "content": f"Snippet {i} about the query.", "engine": "fake"} for i in range(1, 11)]
RESULTS[6] = {"url": "https://docs.python.org/3/library/json.html", "title": "json - Python docs",
              "content": "JSON encoder and decoder.", "engine": "fake"}
RESULTS[8] = {"url": "https://www.python.org/about/", "title": "About Python", "content": "About.", "engine": "fake"}
ODD = [{"url": "javascript:alert(1)", "title": "x", "content": "x"}, {"url": "ftp://files.example.com/x"}]


class FakeSearxng:
    def __init__(self) -> None:
        self.queries: list[str] = []
        self.followed = 0
        self.mode = "ok"
        self.delay_s = 30.0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                parts = urlsplit(self.path)
                if parts.path == "/elsewhere":
                    fake.followed += 1
                    self._send(200, "application/json", json.dumps({"results": RESULTS}).encode())
                    return
                query = parse_qs(parts.query)
                fake.queries.append(query.get("q", [""])[0])
                if fake.mode == "slow":
                    time.sleep(fake.delay_s)
                if fake.mode == "redirect":
                    self.send_response(302)
                    self.send_header("Location", "/elsewhere")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif fake.mode == "huge":
                    self._send(200, "application/json", json.dumps({"results": RESULTS, "pad": "x" * (2 << 20)}
                                                                   ).encode())
                elif fake.mode == "html":
                    self._send(200, "text/html", b"<html><body>results</body></html>")
                else:
                    body: dict[str, Any] = {"query": query.get("q", [""])[0], "results": [*ODD[:1], *RESULTS, *ODD[1:]]}
                    self._send(200, "application/json", json.dumps(body).encode())

            def _send(self, status: int, kind: str, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    return  # the client gave up (a timeout, a size bound): what the test wants

            def log_message(self, format: str, *args: Any) -> None:
                return  # quiet

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-searxng", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/search"

    def start(self) -> FakeSearxng:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
