"""HTTP-level hardening, against a real server over loopback sockets:
the login form's body limit and timeout, header and idle deadlines, the
per-client connection cap, the Host allowlist, JSON-only bodies and log
injection."""

from __future__ import annotations

import json
import selectors
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.server import Server, running, short_tempdir

pytestmark = pytest.mark.timeout(90)

ADMIN = "gva_0123abcd_" + "A" * 43
HEADER_TIMEOUT = 2.0
KEEPALIVE_TIMEOUT = 5.0
PER_CLIENT = 100
# Another loopback address: its connections are not counted with 127.0.0.1's.
OTHER_CLIENT = "127.0.0.2"


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    env = {"GPUVISOR_ADMIN_TOKEN": ADMIN, "GPUVISOR_BODY_TIMEOUT": "1",
           "GPUVISOR_HEADER_TIMEOUT": str(HEADER_TIMEOUT), "GPUVISOR_KEEPALIVE_TIMEOUT": str(KEEPALIVE_TIMEOUT),
           "GPUVISOR_MAX_CONNECTIONS_PER_CLIENT": str(PER_CLIENT),
           "GPUVISOR_TRUSTED_HOSTS": "gpu.example.org,*.lab.example"}
    # No model: nothing here generates.
    with running(Server(short_tempdir("gvm"), env=env)) as server:
        yield server


def _connect(srv: Server, source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.port), timeout=10, source_address=(source, 0))


def _read_until_closed(s: socket.socket) -> bytes:
    received = b""
    try:
        while chunk := s.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass  # an abort is a close too
    return received


def _closed_within(socks: list[socket.socket], timeout: float) -> dict[socket.socket, float]:
    """When each socket saw its end (EOF or reset), waiting at most ``timeout``."""
    sel = selectors.DefaultSelector()
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    socks_by_fd = {s.fileno(): s for s in socks}
    ended: dict[socket.socket, float] = {}
    deadline = time.monotonic() + timeout
    while len(ended) < len(socks) and (left := deadline - time.monotonic()) > 0:
        for key, _ in sel.select(left):
            s = socks_by_fd[key.fd]
            try:
                data = s.recv(65536)
            except ConnectionResetError:
                data = b""
            if not data:
                ended[s] = time.monotonic()
                sel.unregister(s)
    sel.close()
    return ended


def _openai_error(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code and error["message"] and "type" in error


# ---------------------------------------------------------------- 6: the login form


def test_login_form_has_a_small_body_limit(srv: Server) -> None:
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    big = httpx.post(srv.base_url + "/login", content=b"token=" + b"a" * (1 << 20), headers=form, timeout=30)
    _openai_error(big, 413, "request_too_large")

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit holds while reading
        yield b"token="
        for _ in range(16):
            yield b"a" * 1024

    streamed = httpx.post(srv.base_url + "/login", content=chunked(), headers=form, timeout=30)
    _openai_error(streamed, 413, "request_too_large")
    ok = httpx.post(srv.base_url + "/login", data={"token": ADMIN})
    assert ok.status_code == 303 and "gpuvisor_session" in ok.headers["Set-Cookie"]


def test_login_body_times_out_like_json_bodies(srv: Server) -> None:
    with _connect(srv) as s:
        t0 = time.monotonic()
        s.sendall(b"POST /login HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  b"Content-Type: application/x-www-form-urlencoded\r\nContent-Length: 1000\r\n\r\ntoken=ab")
        received = _read_until_closed(s)
        took = time.monotonic() - t0
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), received[:300]
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert took < 10  # body_timeout is 1 s: a coarse bound


# ---------------------------------------------------------------- 7: slowloris


def test_partial_headers_are_closed_and_others_still_served(srv: Server) -> None:
    attackers = 300
    t0 = time.monotonic()
    socks = [_connect(srv) for _ in range(attackers)]
    try:
        for s in socks:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        # Meanwhile another client is served at once.
        with httpx.Client(transport=httpx.HTTPTransport(local_address=OTHER_CLIENT), timeout=5) as http:
            assert http.get(srv.base_url + "/healthz").status_code == 200
        ended = _closed_within(socks, HEADER_TIMEOUT + 10)
    finally:
        for s in socks:
            s.close()
    assert len(ended) == attackers, f"{attackers - len(ended)} connections were never closed"
    # Over the cap: closed at once; the rest when their header deadline passed.
    early = sum(1 for when in ended.values() if when - t0 < HEADER_TIMEOUT)
    assert early >= attackers - PER_CLIENT, early
    assert max(ended.values()) - t0 < HEADER_TIMEOUT + 5


def test_trickled_headers_do_not_extend_the_deadline(srv: Server) -> None:
    with _connect(srv) as s:
        t0 = time.monotonic()
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        s.settimeout(0.3)
        closed = False
        while not closed and time.monotonic() - t0 < HEADER_TIMEOUT + 5:
            try:
                s.sendall(b"X")  # one byte of a header line, again and again
                closed = s.recv(1) == b""
            except TimeoutError:
                continue  # still open: trickle on
            except (BrokenPipeError, ConnectionResetError):
                closed = True
        assert closed and time.monotonic() - t0 < HEADER_TIMEOUT + 5


def test_idle_keepalive_outlives_the_header_deadline_then_closes(srv: Server) -> None:
    with _connect(srv) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        t0 = time.monotonic()
        # Idle past the header deadline: an idle connection is not a slow header.
        assert not _closed_within([s], HEADER_TIMEOUT + 1)
        s.setblocking(True)
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        t0 = time.monotonic()
        assert _closed_within([s], KEEPALIVE_TIMEOUT + 5)
        assert time.monotonic() - t0 < KEEPALIVE_TIMEOUT + 5


# ---------------------------------------------------------------- 11: hosts and bodies


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8470", "lab.example", "gpu.example.org.evil"])
def test_foreign_host_names_are_refused(srv: Server, host: str) -> None:
    r = httpx.get(srv.base_url + "/healthz", headers={"Host": host})
    _openai_error(r, 421, "untrusted_host")
    # X-Forwarded-Host from an untrusted peer changes nothing.
    r = httpx.get(srv.base_url + "/v1/models", headers={"Host": host, "X-Forwarded-Host": "localhost"})
    _openai_error(r, 421, "untrusted_host")


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "app.localhost:1", "[::1]:8470",
                                  "gpu.example.org", "GPU.example.org.", "a.lab.example"])
def test_own_host_names_are_served(srv: Server, host: str) -> None:
    assert httpx.get(srv.base_url + "/healthz", headers={"Host": host}).status_code == 200


def test_json_routes_take_only_json_bodies(srv: Server) -> None:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    body = json.dumps({"model": "none", "messages": [{"role": "user", "content": "hi"}]})
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        for path in ("/v1/chat/completions", "/api/jobs"):
            r = httpx.post(srv.base_url + path, content=body, headers={**admin, "Content-Type": content_type})
            _openai_error(r, 415, "unsupported_media_type")
    no_type = httpx.post(srv.base_url + "/v1/embeddings", content=body, headers=admin)
    _openai_error(no_type, 415, "unsupported_media_type")
    # Still working: JSON, bodiless POSTs, the multipart upload and the login form.
    as_json = httpx.post(srv.base_url + "/v1/chat/completions", content=body,
                         headers={**admin, "Content-Type": "application/json; charset=utf-8"})
    assert as_json.status_code == 404, as_json.text  # no such model: past the media type
    assert httpx.post(srv.base_url + "/api/jobs/nope/cancel", headers=admin).status_code == 404
    upload = httpx.post(srv.base_url + "/api/datasets", headers=admin,
                        files={"file": ("sec.jsonl", b'{"messages": []}\n', "application/octet-stream")})
    assert upload.status_code == 201, upload.text
    # Unauthenticated: 401 comes first.
    assert httpx.post(srv.base_url + "/v1/chat/completions", content=body,
                      headers={"Content-Type": "text/plain"}).status_code == 401


# ---------------------------------------------------------------- 13: log injection


def test_request_fields_cannot_forge_log_lines(srv: Server) -> None:
    forged = "2099-01-01 00:00:00,000 INFO gpuvisor.access: FORGED"
    target = ("/healthz%0A" + forged.replace(" ", "%20") + "%1B%5B31m%E2%80%A8").encode()
    with _connect(srv) as s:
        s.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Request-Id: inject-1\r\n"
                  b"Connection: close\r\n\r\n")
        assert _read_until_closed(s).startswith(b"HTTP/1.1 401")  # a UI path: the admin's
    deadline = time.monotonic() + 10
    while "inject-1" not in srv.log_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = srv.log_text().splitlines()
    access = [line for line in lines if "inject-1" in line]
    assert access and "/healthz\\n2099-01-01" in access[0], access
    assert "\x1b" not in access[0] and "\u2028" not in srv.log_text()
    assert not [line for line in lines if line.startswith("2099-01-01")]
