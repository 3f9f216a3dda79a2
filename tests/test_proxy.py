"""A real nginx in front of gpuvisor, configured from systemd/nginx.conf.example."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.proxies import TrustedProxies, parse_networks
from tests.server import REPO, Server, short_tempdir

NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
PROXY_ADDR = "127.0.0.2"  # nginx talks to gpuvisor from here: the one trusted address
CLIENT_ADDR = "127.0.0.3"  # the test's client, as seen by nginx
MAX_TOKENS = 3000


def _block(text: str, start: int) -> str:
    """The ``{...}`` block that opens at or after ``start``, with its header."""
    depth, i = 0, text.index("{", start)
    while True:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start : i + 1]
        i += 1


def nginx_config(example: str, upstream_port: int, listen_port: int, tmp: Path) -> str:
    """The example's upstream and TLS server, on plain loopback HTTP.

    TLS is stripped, so the test stands in for it: X-Forwarded-Proto is
    https as it would be behind TLS, and the upstream Host is nginx's default
    (the upstream name), so a honoured X-Forwarded-Host can be told apart.
    """
    upstream = _block(example, example.index("upstream gpuvisor"))
    upstream = upstream.replace("127.0.0.1:8470", f"127.0.0.1:{upstream_port}")
    server = _block(example, example.rindex("server {", 0, example.index("listen 443")))
    kept = []
    for line in server.splitlines():
        word = line.strip().split(" ")[0]
        if word in ("listen", "http2") or word.startswith("ssl_"):
            continue
        if "proxy_set_header Host " in line:
            continue
        kept.append(line.replace("X-Forwarded-Proto $scheme", "X-Forwarded-Proto https"))
    kept.insert(1, f"    listen 127.0.0.1:{listen_port};\n    proxy_bind {PROXY_ADDR};")
    return f"""
worker_processes 1;
error_log {tmp}/error.log info;
pid {tmp}/nginx.pid;
events {{ worker_connections 64; }}
http {{
    access_log {tmp}/access.log;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
{upstream}
{chr(10).join(kept)}
}}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def backend(tiny_model_path: Path) -> Iterator[Server]:
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    srv = Server(models, env={"GPUVISOR_N_CTX": "4096", "GPUVISOR_TRUSTED_PROXIES": PROXY_ADDR,
                              "GPUVISOR_LOG_FORMAT": "json"})
    srv.start()
    try:
        yield srv
    finally:
        srv.cleanup()


@pytest.fixture(scope="module")
def nginx(backend: Server) -> Iterator[str]:
    if NGINX is None:
        pytest.skip("nginx is not installed (apt-get install -y nginx)")
    tmp = short_tempdir("gvx")
    tmp.chmod(0o777)  # nginx workers may run as nobody
    port = _free_port()
    example = (REPO / "systemd" / "nginx.conf.example").read_text()
    conf = tmp / "nginx.conf"
    conf.write_text(nginx_config(example, backend.port, port, tmp))
    proc = subprocess.Popen([NGINX, "-p", str(tmp), "-c", str(conf), "-g", "daemon off;"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    err = proc.stderr.read().decode() if proc.stderr else ""
                    raise RuntimeError(f"nginx did not start: {err}") from None
            time.sleep(0.05)
        yield url
    finally:
        proc.send_signal(signal.SIGQUIT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def _client() -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(local_address=CLIENT_ADDR), timeout=60)


def _stream_body(model: str) -> dict[str, Any]:
    return {"model": model, "stream": True, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "temperature": 0, "messages": [{"role": "user", "content": "go on"}]}


def _access(backend: Server, request_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for line in backend.log_text().splitlines():
            if line.startswith("{") and request_id in line:
                rec: dict[str, Any] = json.loads(line)
                if rec.get("logger") == "gpuvisor.access":
                    return rec
        time.sleep(0.05)
    raise AssertionError(f"no access line for {request_id}")


def test_stream_arrives_incrementally(nginx: str, backend: Server) -> None:
    with _client() as http:
        t0 = time.monotonic()
        first = None
        deltas = 0
        with http.stream("POST", nginx + "/v1/chat/completions", json=_stream_body(backend.model)) as r:
            assert r.status_code == 200
            assert r.headers["X-Request-Id"]
            for line in r.iter_lines():
                if line.startswith("data: {") and '"content"' in line:
                    deltas += 1
                    if first is None:
                        first = time.monotonic() - t0
        total = time.monotonic() - t0
    assert first is not None and deltas > 100
    # Buffered, the first delta would arrive with the last.
    assert first < total / 3, (first, total)
    # The path-prefix location of the example works as well.
    assert httpx.get(nginx + "/gpuvisor/healthz").json()["status"] == "ok"


def test_client_disconnect_at_nginx_cancels_generation(nginx: str, backend: Server) -> None:
    before = backend.worker()["stats"]
    cancelled = before["requests_cancelled"] if before else 0
    with _client() as http, http.stream("POST", nginx + "/v1/chat/completions",
                                        json=_stream_body(backend.model)) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n > 20:
                break
    w = backend.wait_worker(lambda w: w["stats"] and w["stats"]["requests_cancelled"] > cancelled
                            and not w["stats"]["busy"], timeout=20)
    assert w["stats"]["requests_cancelled"] == cancelled + 1


def test_forwarded_headers_only_from_the_trusted_proxy(nginx: str, backend: Server) -> None:
    spoof = {"X-Forwarded-For": "203.0.113.7", "X-Forwarded-Host": "evil.example",
             "X-Forwarded-Proto": "https"}
    with _client() as http:
        via = http.get(nginx + "/healthz", headers={"Host": "gpu.example.org", **spoof})
        direct = http.get(backend.base_url + "/healthz", headers=spoof)
    seen = _access(backend, via.headers["X-Request-Id"])
    # Through nginx: the real client (the forged left entry is skipped),
    # the public host and scheme.
    assert (seen["client"], seen["host"], seen["scheme"]) == (CLIENT_ADDR, "gpu.example.org", "https")
    # Straight from an untrusted address: every forwarded header ignored.
    seen = _access(backend, direct.headers["X-Request-Id"])
    assert (seen["client"], seen["scheme"]) == (CLIENT_ADDR, "http")
    assert seen["host"] == f"127.0.0.1:{backend.port}"


def test_forwarded_for_walk() -> None:
    proxies = TrustedProxies(parse_networks(["10.0.0.0/8", "::1"]))
    assert proxies.trusts("10.1.2.3") and proxies.trusts("::1") and not proxies.trusts("11.0.0.1")
    assert proxies.client("10.0.0.1", "1.1.1.1, 2.2.2.2, 10.0.0.5") == "2.2.2.2"
    assert proxies.client("10.0.0.1", "garbage") == "10.0.0.1"
    assert proxies.client("10.0.0.1", "[2001:db8::1]:443") == "2001:db8::1"
    with pytest.raises(ValueError, match="not-an-ip"):
        parse_networks(["not-an-ip"])
