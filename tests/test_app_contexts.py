"""Each resource has its own cleanup context: a failed start unwinds the ones
already up, in reverse, instead of leaving their tasks and processes behind."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from supervisor.app import build_app
from supervisor.appkeys import DB, LEASE, POOL
from supervisor.config import load_config
from supervisor.service.serving import Service
from supervisor.service.systemd import Notifier
from tests.server import short_tempdir


def test_a_runner_that_cannot_start_unwinds_the_pool_and_database(tiny_model_path: Path) -> None:
    state = short_tempdir("gvs")
    models = state / "models"
    models.mkdir()
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    blocker = state / "not-a-dir"
    blocker.write_text("the outputs dir cannot be made here")
    cfg = load_config({"state_dir": str(state), "models_dir": str(models)},
                      environ={"GPUVISOR_OUTPUTS_DIR": str(blocker / "outputs"), "GPUVISOR_PORT": "0"})
    app = build_app(cfg)
    service = Service(cfg, app, Notifier(None))

    async def attempt() -> None:
        with socket.create_server(("127.0.0.1", 0)) as sock:
            await service.run(sock)

    with pytest.raises(NotADirectoryError):
        asyncio.run(attempt())
    # The runner's context failed; the pool, lease and database before it unwound.
    assert LEASE in app and POOL in app
    reaper = app[POOL]._reaper
    assert reaper is not None and reaper.done()
    with pytest.raises(RuntimeError, match="not open"):
        _ = app[DB].conn
