"""A simulated 2-GPU box with real processes: a model worker serving on one
GPU keeps serving while a real finetune job runs on the other, and each
process sees exactly its own GPU (read from the processes' environments).

The GPUs are recorded readings (this machine has none); the engine is the
real one on the CPU, which ignores the CUDA variables, and torch trains on
the CPU: what is checked is the arbitration and the pinning.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from jobs.kinds import validate_params
from jobs.params import ResolveContext
from supervisor.app import timing_from
from supervisor.config import Config
from supervisor.lab.gpu_setup import gpu_room
from supervisor.lab.lease import GpuLease, devices_from_readings
from supervisor.lab.runner import JobRunner, RunnerSettings
from supervisor.models.devices import RecordedSource, gpu_box
from supervisor.models.library import ModelLibrary
from supervisor.models.settle import Settler
from supervisor.models.source import LibrarySource
from supervisor.workers.pool import WorkerPool
from tests.jobsupport import make_roots, open_store, wait_finished, wait_for
from tests.tiny_hf import build_tiny_model, copy_model, write_chat_dataset
from worker import protocol as p

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(autouse=True)
def one_torch_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    # Job processes inherit it: spinning OpenMP threads slow a tiny model down.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _pinned(pid: int) -> dict[str, str]:
    env = psutil.Process(pid).environ()
    return {k: env.get(k, "<unset>") for k in
            ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")}


async def _chat(pool: WorkerPool) -> p.Done:
    gen = await pool.admit("tiny", messages=[p.ChatMessage(role="user", content="hi")],
                           params=p.SamplingParams(max_tokens=8, temperature=0.0))
    async for ev in gen:
        if isinstance(ev, p.Done):
            return ev
    raise AssertionError("the generation ended without Done")


async def test_finetune_on_one_gpu_leaves_chat_on_the_other(tmp_path: Path, tiny_model_path: Path) -> None:
    roots = make_roots(tmp_path)
    (roots.models / "tiny.gguf").symlink_to(tiny_model_path)
    copy_model(build_tiny_model(tmp_path / "hf" / "tiny-llama"), roots.models)
    write_chat_dataset(roots.datasets / "qa.train.jsonl")
    library = ModelLibrary([roots.models], None, settle_s=0.0)
    library.rescan()
    box = gpu_box([16000, 12000])
    lease = GpuLease(devices_from_readings(box), settler=Settler(RecordedSource([box]), timeout=0.5))
    cfg = Config(n_ctx=512, min_ctx=256, parallel=1)
    run_dir = tmp_path / "run"
    pool = WorkerPool(LibrarySource(library), cfg, timing_from(cfg), run_dir, tmp_path / "logs",
                      admission=lease.worker_admission, device=lease.default_device,
                      gpus=gpu_room(lease), bookings=lease)
    lease.set_users(pool)
    settings = RunnerSettings(state_dir=tmp_path / "state", roots=roots, python=sys.executable,
                              heartbeat_timeout_s=60.0, keepalive_s=0.5, stop_timeout_s=3.0)
    async with open_store(tmp_path / "state" / "gpuvisor.db") as store:
        runner = JobRunner(store, lease, settings)
        await runner.start()
        try:
            await _scenario(pool, lease, runner, roots)
        finally:
            await runner.stop()
            await pool.stop_all()


async def _scenario(pool: WorkerPool, lease: GpuLease, runner: JobRunner, roots: Any) -> None:
    await pool.facts("tiny")  # loaded and serving
    worker = pool.handles[("tiny", False)]
    assert worker.spec.devices == ("cuda:0",) and worker.pid is not None
    assert _pinned(worker.pid) == dict.fromkeys(
        ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"), "0")
    worker_pid = worker.pid
    params = validate_params("finetune", {
        "model": "tiny-hf", "train": "qa.train.jsonl", "max_steps": 12, "batch_size": 4,
        "gradient_accumulation_steps": 1, "save_steps": 100, "cpu_threads": 1, "merge": False,
    }, ResolveContext(roots))
    job, _ = await runner.submit("finetune", params)
    running = await wait_for(runner.store, job.id, lambda j: j.pid is not None, timeout=60)
    assert running.pid is not None
    # The job got the GPU without a worker and sees only it.
    assert _pinned(running.pid)["CUDA_VISIBLE_DEVICES"] == "1"
    gpu = {d["id"]: d for d in lease.snapshot()["devices"]}
    assert gpu["cuda:1"]["holder"]["job_id"] == job.id and gpu["cuda:0"]["holder"] is None
    assert gpu["cuda:0"]["workers"] == ["tiny"]
    # Chat on cuda:0 keeps being served while the finetune holds cuda:1.
    for _ in range(3):
        done = await asyncio.wait_for(_chat(pool), 60)
        assert done.completion_tokens > 0
    still = await runner.store.get(job.id)
    assert still.status == "running", "the finetune ended before chat was checked beside it"
    finished = await wait_finished(runner.store, job.id, timeout=180)
    assert finished.status == "succeeded", finished.error
    # The worker was never evicted: same process throughout.
    assert pool.handles[("tiny", False)].pid == worker_pid
