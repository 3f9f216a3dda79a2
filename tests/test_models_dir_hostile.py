"""Crafted files in the models dir cost themselves, never the library or start-up."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import gguf
import httpx
import pytest

from tests.server import Server, short_tempdir

pytestmark = pytest.mark.timeout(120)


def _huge_block_count(path: Path) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint64("llama.block_count", 2**64 - 1)
    w.add_uint32("llama.context_length", 2048)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()


def _models_listed(srv: Server) -> dict[str, dict[str, object]]:
    return {m["id"]: m for m in httpx.get(srv.base_url + "/v1/models", timeout=10).json()["data"]}


def test_crafted_files_do_not_stop_the_library(tiny_model_path: Path,
                                               start_server: Callable[..., Server]) -> None:
    models = short_tempdir("gvh")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    _huge_block_count(models / "overflow.gguf")
    os.mkfifo(models / "fifo.gguf")  # an open() of it would block start-up forever
    (models / "root.gguf").symlink_to("/")
    (models / "dir.gguf").mkdir()
    srv = start_server(models)
    listed = _models_listed(srv)
    assert listed["tiny"]["state"] in ("ready", "starting", "unloaded")
    assert "fifo" not in listed and "root" not in listed and "dir" not in listed
    # The crafted header is listed as unusable, with a reason, not a crash.
    assert listed["overflow"]["state"] == "unusable", listed["overflow"]
    # The watcher still follows the directory.
    shutil.copy(tiny_model_path, models / ".later.tmp")
    os.replace(models / ".later.tmp", models / "later.gguf")
    deadline = time.monotonic() + 30
    while "later" not in _models_listed(srv):
        assert time.monotonic() < deadline, "the library stopped watching"
        time.sleep(0.1)
    assert "watcher failed" not in srv.log_text()
