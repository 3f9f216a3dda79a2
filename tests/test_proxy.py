"""A real nginx in front of gpuvisor, configured from systemd/nginx.conf.example."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from supervisor.api.proxies import TrustedProxies, parse_networks
from tests.server import Server

# The nginx and backend fixtures, shared with the UI-through-nginx test.
pytest_plugins = ["tests.proxy_support"]

CLIENT_ADDR = "127.0.0.3"  # the test's client, as seen by nginx
MAX_TOKENS = 3000


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
        # /v1/models, not the polled /healthz: its access line is at INFO.
        via = http.get(nginx + "/v1/models", headers={"Host": "gpu.example.org", **spoof})
        direct = http.get(backend.base_url + "/v1/models", headers=spoof)
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
