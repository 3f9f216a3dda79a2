"""A failed model stays failed: making room for other models, a job's need
for the device or a memory budget never drop it (which would make the next
request load it again); an explicit load starts it afresh.

Real worker processes on the real engine; the failure is a crash loop made
by killing the worker (crash_limit 1).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from supervisor.app import timing_from
from supervisor.config import Config, ModelSettings
from supervisor.errors import ModelFailed
from supervisor.lab.lease import CPU, GpuLease, cpu_device
from supervisor.models.demo import write_tiny_gguf
from supervisor.models.library import ModelLibrary
from supervisor.models.source import LibrarySource
from supervisor.workers.handle import WorkerState
from supervisor.workers.pool import WorkerPool
from worker import protocol as p

pytestmark = pytest.mark.timeout(120)


@asynccontextmanager
async def _pool(tmp_path: Path, tiny_model_path: Path, cfg: Config) -> AsyncIterator[tuple[WorkerPool, GpuLease]]:
    models = tmp_path / "models"
    models.mkdir()
    (models / "alpha.gguf").symlink_to(tiny_model_path)
    write_tiny_gguf(models / "beta.gguf", seed=1)
    write_tiny_gguf(models / "gamma.gguf", seed=2)
    library = ModelLibrary([models], None, settle_s=0.0)
    library.rescan()
    lease = GpuLease([cpu_device()], drain_timeout=1.0)
    pool = WorkerPool(LibrarySource(library), cfg, timing_from(cfg), tmp_path / "run", tmp_path / "logs",
                      admission=lease.worker_admission, device=lease.default_device, bookings=lease)
    lease.set_users(pool)
    try:
        yield pool, lease
    finally:
        await pool.stop_all()


async def _fail(pool: WorkerPool, model: str) -> str:
    """Crash the model's worker once (crash_limit 1: then it is failed); its reason."""
    await pool.facts(model)
    handle = pool.handles[(model, False)]
    assert handle.pid is not None
    os.kill(handle.pid, signal.SIGKILL)
    while handle.state is not WorkerState.FAILED:
        handle.changed.clear()
        await asyncio.wait_for(handle.changed.wait(), 30)
    assert handle.reason is not None
    return handle.reason


async def _chat(pool: WorkerPool, model: str) -> p.Done:
    gen = await pool.admit(model, messages=[p.ChatMessage(role="user", content="hi")],
                           params=p.SamplingParams(max_tokens=4, temperature=0.0))
    async for ev in gen:
        if isinstance(ev, p.Done):
            return ev
    raise AssertionError("the generation ended without Done")


def _still_failed(pool: WorkerPool, model: str, reason: str) -> None:
    status = pool.status(model)
    assert status is not None, f"{model}'s failed state was dropped"
    assert status["state"] == "failed" and status["reason"] == reason


async def test_a_failed_model_is_not_evicted_and_stays_failed(tmp_path: Path, tiny_model_path: Path) -> None:
    cfg = Config(n_ctx=512, min_ctx=256, parallel=1, n_threads=1, crash_limit=1, max_loaded_models=1)
    async with _pool(tmp_path, tiny_model_path, cfg) as (pool, lease):
        reason = await _fail(pool, "alpha")
        assert "crash" in reason
        # It uses no device any more, but is still listed, failed.
        assert lease.workers_on()[CPU] == []
        _still_failed(pool, "alpha", reason)

        # One model at a time: beta, then gamma, take the only place. Room is
        # made by stopping beta; the failed alpha is never the one taken.
        assert (await _chat(pool, "beta")).completion_tokens > 0
        assert (await _chat(pool, "gamma")).completion_tokens > 0
        assert pool.status("beta") is None
        _still_failed(pool, "alpha", reason)

        # A job taking the device stops what runs there; alpha runs nothing.
        await asyncio.wait_for(lease.acquire_job("job_1", "sleep", [CPU], 0), 30)
        lease.release_job("job_1")
        assert pool.status("gamma") is None
        _still_failed(pool, "alpha", reason)

        # A request is told it failed, at once, and starts nothing.
        with pytest.raises(ModelFailed, match="load it again"):
            await _chat(pool, "alpha")
        _still_failed(pool, "alpha", reason)

        # Loaded again explicitly: a new worker, which serves.
        await pool.load("alpha", options=ModelSettings())
        assert (await _chat(pool, "alpha")).completion_tokens > 0
        status = pool.status("alpha")
        assert status is not None and status["state"] == "ready" and status["reason"] is None
        assert lease.workers_on()[CPU] == ["alpha"]


async def test_a_failed_model_frees_its_share_of_the_memory_budget(tmp_path: Path, tiny_model_path: Path) -> None:
    cfg = Config(n_ctx=512, min_ctx=256, parallel=1, n_threads=1, crash_limit=1)
    async with _pool(tmp_path, tiny_model_path, cfg) as (pool, _lease):
        reason = await _fail(pool, "alpha")
        fit = pool.fits[("alpha", False)]
        assert fit is not None
        # Room for one such model, not two: with alpha's plan still counted,
        # beta would not fit, and alpha would be dropped to make room.
        cfg.memory_budget_mib = (fit.needed_bytes >> 20) + 1
        assert (await _chat(pool, "beta")).completion_tokens > 0
        _still_failed(pool, "alpha", reason)
