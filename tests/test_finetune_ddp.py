"""Data-parallel fine-tunes on simulated devices, and the memory savers.

The lease lists two configured GPUs (``cuda:0``, ``cuda:1``) on a machine
whose torch has no CUDA: a job booking both runs two CPU ranks over gloo,
as it would run two CUDA ranks over NCCL on a real two-GPU machine.
"""

from __future__ import annotations

import json
import math
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest

pytest.importorskip("peft", reason="needs the train extra")

from jobs.finetune_params import FinetuneParams
from jobs.kinds import validate_params
from jobs.params import ResolveContext
from supervisor.lab.lease import GpuLease, device_from_id
from supervisor.lab.runner import JobRunner, RunnerSettings
from tests.jobsupport import Lab, make_roots, open_store, wait_finished, wait_for
from tests.tiny_hf import build_tiny_model, copy_model, write_chat_dataset

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(autouse=True)
def one_torch_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each rank on one thread: two ranks share this small machine's cores.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("hf") / "tiny-llama")


@asynccontextmanager
async def gpu_lab(base: Path, gpus: int = 2) -> AsyncIterator[Lab]:
    """A runner whose lease has ``gpus`` (simulated) GPUs."""
    roots = make_roots(base)
    cfg = RunnerSettings(state_dir=base / "state", roots=roots, heartbeat_timeout_s=30.0,
                         keepalive_s=0.5, stop_timeout_s=3.0)
    async with open_store(base / "state" / "gpuvisor.db") as store:
        lease = GpuLease([device_from_id(f"cuda:{i}") for i in range(gpus)])
        runner = JobRunner(store, lease, cfg)
        await runner.start()
        try:
            yield Lab(store, lease, runner, roots, cfg)
        finally:
            await runner.stop()


def _params(lab: Lab, model: Path, **over: Any) -> FinetuneParams:
    if not (lab.roots.models / "tiny-hf").exists():
        copy_model(model, lab.roots.models)
    write_chat_dataset(lab.roots.datasets / "qa.train.jsonl")
    raw: dict[str, Any] = {
        "model": "tiny-hf", "train": "qa.train.jsonl", "max_steps": 8, "learning_rate": 5e-3,
        "batch_size": 2, "gradient_accumulation_steps": 1, "save_steps": 4, "gpus": 2,
    }
    raw.update(over)
    params = validate_params("finetune", raw, ResolveContext(lab.roots))
    assert isinstance(params, FinetuneParams)
    params.devices(lab.lease.devices)  # what the submit route checks
    return params


async def _events(lab: Lab, job_id: str) -> list[tuple[str, dict[str, Any]]]:
    return [(e.type, e.data) for e in await lab.store.events_after(job_id, 0, 10_000)]


def _logs(events: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    return [d for t, d in events if t == "log"]


async def test_two_devices_train_two_ranks_into_one_adapter(tmp_path: Path, tiny_hf: Path) -> None:
    async with gpu_lab(tmp_path) as lab:
        params = _params(lab, tiny_hf, export_adapter=True)
        job, _ = await lab.runner.submit("finetune", params)
        done = await wait_finished(lab.store, job.id, timeout=150)
        assert done.status == "succeeded", done.error
        events = await _events(lab, job.id)
    result = done.result or {}
    assert result["world_size"] == 2 and result["steps"] == 8
    # Both ranks trained every step, each on its own half of every step's samples.
    ranks = result["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["device"] == "cpu" and r["steps"] == 8 and r["samples"] == 8 * 2 and r["tokens"] > 0
    rank_logs = {d["rank"]: d["message"] for d in _logs(events) if "rank" in d}
    assert set(rank_logs) == {0, 1}, rank_logs
    assert "rank 1 of 2 on cpu: 8 steps, 16 samples" in rank_logs[1]
    # One place reports progress: one event per step, with the tokens of both ranks.
    steps = [d for t, d in events if t == "progress" and "step" in d]
    assert [d["step"] for d in steps] == list(range(1, 9))
    assert sum(d["tokens"] for d in steps) == sum(r["tokens"] for r in ranks)
    assert all(math.isfinite(d["loss"]) for d in steps) and math.isfinite(result["final_loss"])
    assert steps[-1]["loss"] < steps[0]["loss"]
    # The same numbers as one process reading both ranks' micro-batches.
    assert [d["loss"] for d in steps] == pytest.approx(_one_process_losses(params), rel=1e-4)
    stages = [d["stage"] for t, d in events if t == "stage"]
    assert stages == ["loading", "training", "saving", "merging", "converting adapter"]
    # Saved once: one checkpoint at step 4, one adapter, one merged model.
    out = Path(result["output_dir"])
    assert sorted(p.name for p in out.iterdir()) == ["adapter", "checkpoints", "merged"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["checkpoint-4"]
    checkpoints = [d for t, d in events if t == "metric" and "checkpoint" in d]
    assert [d["step"] for d in checkpoints] == [4]
    _check_adapter(lab.roots.models / "tiny-hf", Path(result["adapter_path"]), Path(result["merged_path"]))
    # And exported for serving as a single-device job's adapter is.
    exported = Path(result["adapter_export"]["path"])
    assert exported.parent == lab.roots.models and exported.stat().st_size > 0
    assert result["adapter_export"]["arch"] == "llama"


def _one_process_losses(params: FinetuneParams) -> list[float]:
    """Per-step losses of the single-process loop with twice the accumulation:
    the very micro-batches the two ranks split between them."""
    import io

    import msgspec

    from jobs.events import JobIO
    from jobs.finetune import build_trainer
    from jobs.finetune_loop import NoHooks, StepStats

    class Losses(NoHooks):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_step(self, stats: StepStats) -> None:
            self.losses.append(stats.loss)

    single = msgspec.structs.replace(params, gpus=1, gradient_accumulation_steps=2, save_steps=1000)
    quiet = JobIO(stdin=io.BytesIO(), stdout=io.BytesIO())
    trainer, _ = build_trainer(quiet, single, Path(single.model), Path(params.train).parent / "ckpt")
    hooks = Losses()
    assert trainer.train(hooks)
    return hooks.losses


def _check_adapter(base: Path, adapter: Path, merged: Path) -> None:
    """The adapter loads on its base as any single-device one, and computes
    what the merged model computes."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
    merged_model = AutoModelForCausalLM.from_pretrained(merged)
    ids = torch.tensor([[1, 5, 9, 12, 7]])
    with torch.no_grad():
        a, b = with_adapter(input_ids=ids).logits, merged_model(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(base)(input_ids=ids).logits
    assert torch.allclose(a, b, atol=1e-4)
    assert not torch.allclose(a, plain, atol=1e-3)  # it learned something


async def test_a_killed_rank_fails_the_job_with_its_reason(tmp_path: Path, tiny_hf: Path) -> None:
    async with gpu_lab(tmp_path) as lab:
        params = _params(lab, tiny_hf, max_steps=400, save_steps=1000, merge=False)
        job, _ = await lab.runner.submit("finetune", params)
        running = await wait_for(lab.store, job.id, lambda j: j.progress > 0, timeout=120)
        assert running.pid is not None
        ranks = psutil.Process(running.pid).children()
        assert len(ranks) == 2
        by_rank = {int(p.environ()["RANK"]): p for p in ranks}
        os.kill(by_rank[1].pid, signal.SIGKILL)
        done = await wait_finished(lab.store, job.id, timeout=60)
    assert done.status == "failed"
    assert "rank 1 of 2 failed: killed by SIGKILL" in (done.error or ""), done.error
    gone, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive, alive


async def test_a_killed_job_takes_its_ranks_with_it(tmp_path: Path, tiny_hf: Path) -> None:
    async with gpu_lab(tmp_path) as lab:
        params = _params(lab, tiny_hf, max_steps=400, save_steps=1000, merge=False)
        job, _ = await lab.runner.submit("finetune", params)
        running = await wait_for(lab.store, job.id, lambda j: j.progress > 0, timeout=120)
        assert running.pid is not None
        ranks = psutil.Process(running.pid).children()
        assert len(ranks) == 2
        os.kill(running.pid, signal.SIGKILL)
        done = await wait_finished(lab.store, job.id, timeout=60)
        assert done.status == "failed" and "SIGKILL" in (done.error or "")
    gone, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive, alive


async def test_cancel_with_save_then_resume_on_both_ranks(tmp_path: Path, tiny_hf: Path) -> None:
    async with gpu_lab(tmp_path) as lab:
        params = _params(lab, tiny_hf, max_steps=60, save_steps=1000, merge=False)
        job, _ = await lab.runner.submit("finetune", params)
        await wait_for(lab.store, job.id, lambda j: j.progress >= 2 / 60, timeout=120)
        await lab.runner.cancel(job.id, save=True)
        stopped = await wait_finished(lab.store, job.id, timeout=60)
        assert stopped.status == "cancelled", stopped.error
        before = [d["step"] for t, d in await _events(lab, job.id) if t == "progress" and "step" in d]
        # Every rank stopped at the same step: one checkpoint, of the last step reported.
        ckpts = sorted((tmp_path / "outputs" / job.id / "checkpoints").iterdir())
        assert [p.name for p in ckpts] == [f"checkpoint-{before[-1]}"]
        assert json.loads((ckpts[0] / "state.json").read_text())["step"] == before[-1]

        await lab.runner.resume(job.id)
        done = await wait_finished(lab.store, job.id, timeout=150)
        assert done.status == "succeeded", done.error
        steps = [d["step"] for t, d in await _events(lab, job.id) if t == "progress" and "step" in d]
    result = done.result or {}
    assert result["resumed_from_step"] == before[-1] and result["world_size"] == 2
    assert steps == before + list(range(before[-1] + 1, 61))
    assert [r["steps"] for r in result["ranks"]] == [60 - before[-1]] * 2
