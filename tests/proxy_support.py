"""A real nginx in front of a real gpuvisor, configured from
systemd/nginx.conf.example: the config rewrite and the module-scoped
``backend`` and ``nginx`` fixtures that the proxy tests share."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import httpx
import pytest

from tests.server import REPO, Server, running, short_tempdir

NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
PROXY_ADDR = "127.0.0.2"  # nginx talks to gpuvisor from here: the one trusted address
BEHIND_TLS = {"X-Forwarded-Proto": "https"}  # what nginx would send with TLS on


def _block(text: str, start: int) -> str:
    """The ``{...}`` block that opens at or after ``start``, with its header."""
    depth, i = 0, text.index("{", start)
    while True:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start : i + 1]
        i += 1


def nginx_config(example: str, upstream_port: int, listen_port: int, tmp: Path,
                 forwarded: Mapping[str, str] = BEHIND_TLS) -> str:
    """The example's upstream and TLS server, on plain loopback HTTP.

    TLS is stripped, so the test stands in for it: ``forwarded`` replaces the
    values of those proxy_set_header lines (by default X-Forwarded-Proto is
    https, as it would be behind TLS), and the upstream Host is nginx's
    default (the upstream name), so a honoured X-Forwarded-Host can be told
    apart.
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
        words = line.split()
        if words[:1] == ["proxy_set_header"] and words[1] in forwarded:
            indent = line[: len(line) - len(line.lstrip())]
            line = f"{indent}proxy_set_header {words[1]} {forwarded[words[1]]};"
        kept.append(line)
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
    env = {"GPUVISOR_N_CTX": "4096", "GPUVISOR_TRUSTED_PROXIES": PROXY_ADDR, "GPUVISOR_LOG_FORMAT": "json"}
    with running(Server(models, env=env)) as srv:
        yield srv


@pytest.fixture(scope="module")
def forwarded() -> Mapping[str, str]:
    """proxy_set_header values that differ from the example (see nginx_config);
    a test module overrides this fixture to change them."""
    return BEHIND_TLS


@pytest.fixture(scope="module")
def nginx(backend: Server, forwarded: Mapping[str, str]) -> Iterator[str]:
    """nginx's base URL (``http://127.0.0.1:<port>``), started for the module."""
    if NGINX is None:
        pytest.skip("nginx is not installed (apt-get install -y nginx)")
    tmp = short_tempdir("gvx")
    tmp.chmod(0o777)  # nginx workers may run as nobody
    port = _free_port()
    example = (REPO / "systemd" / "nginx.conf.example").read_text()
    conf = tmp / "nginx.conf"
    conf.write_text(nginx_config(example, backend.port, port, tmp, forwarded))
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
