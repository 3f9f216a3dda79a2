"""Unparsable requests cost a few bytes each and come before auth: each once
wrote aiohttp's 11-line traceback. Now each gets its 400 and the log gets a
bounded number of one-line warnings."""

from __future__ import annotations

import logging
import socket
import sys
import time

import httpx

from supervisor.bad_http_log import BURST, BadHttpFilter
from tests.server import Server

BAD = b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\x01: y\r\n\r\n"


def test_a_flood_of_bad_headers_is_a_few_log_lines(server: Server) -> None:
    before = len(server.log_text().splitlines())
    for _ in range(200):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(BAD)
            assert s.recv(100).split(b"\r\n")[0].endswith(b" 400 Bad Request"), "a bad header must get its 400"
    assert httpx.get(server.base_url + "/healthz", timeout=10).status_code == 200
    time.sleep(0.3)  # the parent writes its log asynchronously to this test
    new = server.log_text().splitlines()[before:]
    flood = [line for line in new if "aiohttp.server" in line]
    assert 1 <= len(flood) <= BURST, "\n".join(new[:20])
    assert "Traceback" not in "\n".join(new), "\n".join(new[:20])
    assert "Error handling request from 127.0.0.1" in flood[0] and "Invalid header token" in flood[0], flood[0]


def test_the_next_window_says_how_many_were_left_out() -> None:
    now = [0.0]
    filt = BadHttpFilter(burst=2, window_s=10, clock=lambda: now[0])

    def record() -> logging.LogRecord:
        from aiohttp.http_exceptions import BadHttpMessage
        try:
            raise BadHttpMessage("Invalid header token")
        except BadHttpMessage:
            return logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1,
                                     "Error handling request from %s", ("::1",), sys.exc_info())

    kept = [filt.filter(r := record()) and r.getMessage() for _ in range(5)]
    assert kept[2:] == [False, False, False] and all(kept[:2])
    assert kept[0] == "Error handling request from ::1 (HTTP 400: Invalid header token)"
    now[0] = 11.0
    r = record()
    assert filt.filter(r) and r.getMessage().endswith("; 3 more left out in the last 10 s"), r.getMessage()
    assert r.levelno == logging.WARNING and r.exc_info is None
    other = logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "boom", (), None)
    assert filt.filter(other) and other.levelno == logging.ERROR  # not a client's bad message: untouched


