"""The pool's keep-alive reaper, driven by a fake clock: no sleeping, no worker process."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.app import timing_from
from supervisor.config import Config
from supervisor.models.demo import write_tiny_gguf
from supervisor.models.gguf_info import read_gguf_info
from supervisor.models.library import ModelEntry
from supervisor.workers.handle import WorkerHandle, WorkerState
from supervisor.workers.pool import WorkerPool
from worker import protocol as p_


class _Models:
    def __init__(self, entries: dict[str, ModelEntry]) -> None:
        self.entries = entries

    def entry(self, model_id: str) -> ModelEntry | None:
        return self.entries.get(model_id)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _entry(path: Path, model_id: str) -> ModelEntry:
    return ModelEntry(id=model_id, path=str(path), files=[str(path)], size_bytes=path.stat().st_size,
                      source="dir", root=str(path.parent), mtime=0.0, info=read_gguf_info(path))


@pytest.fixture
def pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[WorkerPool, _Clock]:
    monkeypatch.setattr(WorkerHandle, "start", lambda self: None)  # workers never start
    models = _Models({name: _entry(write_tiny_gguf(tmp_path / f"{name}.gguf"), name) for name in ("a", "b")})
    cfg = Config(n_ctx=1024, min_ctx=1024, load_wait_timeout=0.1)
    clock = _Clock()
    return WorkerPool(models, cfg, timing_from(cfg), tmp_path, tmp_path,  # type: ignore[arg-type]
                      clock=clock), clock


async def test_reap_once_unloads_only_what_outlived_its_keep_alive(pool: tuple[WorkerPool, _Clock]) -> None:
    p, clock = pool
    a, b = await p.load("a"), await p.load("b")
    for h in (a, b):
        h.state = WorkerState.READY  # loaded and idle
    a.keep_alive, b.keep_alive = 10.0, -1.0  # b: kept loaded forever
    assert a.last_used == clock.now  # the handles read the pool's clock
    assert await p.reap_once(clock.now + 9.9) == []
    assert await p.reap_once(clock.now + 10.0) == ["a"]
    assert ("a", False) not in p.handles and not a.accepting
    assert await p.reap_once(clock.now + 1e9) == [] and ("b", False) in p.handles
    await p.stop_all()


async def test_reap_once_spares_busy_and_starting_workers(pool: tuple[WorkerPool, _Clock]) -> None:
    p, clock = pool
    a = await p.load("a")
    a.keep_alive = 0.0
    assert await p.reap_once(clock.now + 60) == []  # still starting
    pend = a.submit(p_.Tokenize(0, "hi", True))  # queued while it starts
    a.state = WorkerState.READY
    assert await p.reap_once(clock.now + 60) == []  # busy
    a.cancel(pend)
    assert await p.reap_once(clock.now + 60) == ["a"]
    await p.stop_all()
