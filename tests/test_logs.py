"""What the service writes to stderr at the default level, read from a real
process: one line per page view (not per asset), no watchfiles chatter, and
every model load's start, end and time taken (or why it failed)."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.bad_models import engine_refused_gguf
from tests.server import Server, poll_until, short_tempdir

ASSET = re.compile(r'(?:src|href)="(static/[^"?]+)')


def _access_lines(log: str, path_prefix: str) -> list[str]:
    return [line for line in log.splitlines() if f"gpuvisor.access: GET {path_prefix}" in line]


def test_a_page_view_is_one_line_and_assets_are_quiet(tiny_model_path: Path,
                                                     start_server: Callable[..., Server]) -> None:
    models = short_tempdir("gvm")
    shutil.copy(tiny_model_path, models / "tiny.gguf")  # a real file: the library watches, not polls
    srv = start_server(models)
    page = httpx.get(srv.base_url + "/", timeout=10)
    assert page.status_code == 200
    assets = sorted(set(ASSET.findall(page.text)))
    assert len(assets) >= 3, assets  # style, script, icon: what a browser fetches next
    for asset in assets:
        assert httpx.get(f"{srv.base_url}/{asset}", timeout=10).status_code == 200
    missing = httpx.get(srv.base_url + "/static/no-such-file.js", timeout=10)
    assert missing.status_code == 404
    # A new model copied in: the library sees it, watchfiles says nothing.
    shutil.copy(tiny_model_path, models / "second.gguf")
    poll_until(lambda: [m["id"] for m in httpx.get(srv.base_url + "/v1/models", timeout=10).json()["data"]],
               lambda ids: "second" in ids, timeout=30)
    assert srv.stop() == 0  # stopped: its log is complete
    log = srv.log_text()
    assert len(_access_lines(log, "/ 200")) == 1, log
    static = _access_lines(log, "/static/")  # only the error is worth a line
    assert len(static) == 1 and "GET /static/no-such-file.js 404" in static[0], static
    assert "watchfiles" not in log and "change detected" not in log and "changes detected" not in log, log


def test_model_loads_are_logged_with_their_time_and_failures(tiny_model_path: Path,
                                                            start_server: Callable[..., Server]) -> None:
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    engine_refused_gguf(models / "broken.gguf")
    srv = start_server(models, env={"GPUVISOR_PRELOAD": "tiny"})
    r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=60,
                   json={"model": "broken", "messages": [{"role": "user", "content": "x"}]})
    assert r.json()["error"]["code"] == "model_failed", r.text
    assert srv.stop() == 0
    log = srv.log_text()
    assert re.search(r"INFO gpuvisor\.worker: loading tiny: n_ctx 1024, \d+ slots?, on cpu", log), log
    assert re.search(r"INFO gpuvisor\.worker: tiny ready in \d+\.\ds \(pid \d+\)", log), log
    assert re.search(r"INFO gpuvisor\.worker: loading broken: ", log), log
    assert re.search(r"ERROR gpuvisor\.worker: cannot load broken: .*broken\.gguf.* \(its log: .*broken\.log\)",
                     log), log
    assert "broken ready" not in log
