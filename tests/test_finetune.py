"""Finetune jobs: real job processes (torch, peft) under a real runner and store.

A tiny random Llama with a freshly trained BPE tokenizer learns a handful of
repeated Q/A pairs in a few dozen CPU steps.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("peft", reason="needs the train extra")

from jobs.context import JobError
from jobs.errors import ParamError
from jobs.finetune_ckpt import complete_checkpoints, newest_checkpoint
from jobs.finetune_params import FinetuneParams
from jobs.kinds import validate_params
from jobs.params import ResolveContext
from supervisor.errors import BadRequest, Conflict
from tests.jobsupport import Lab, running_lab, wait_finished, wait_for
from tests.tiny_hf import build_tiny_model, copy_model, write_chat_dataset

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(autouse=True)
def one_torch_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    # Job processes inherit it: on a small busy machine, spinning OpenMP
    # threads make a tiny model train several times slower.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("hf") / "tiny-llama")


def _params(lab: Lab, model: Path, **over: Any) -> FinetuneParams:
    models = lab.roots.models
    if not (models / "tiny-hf").exists():
        copy_model(model, models)
    write_chat_dataset(lab.roots.datasets / "qa.train.jsonl")
    write_chat_dataset(lab.roots.datasets / "qa.eval.jsonl", repeats=1)
    raw: dict[str, Any] = {
        "model": "tiny-hf", "train": "qa.train.jsonl", "max_steps": 16, "learning_rate": 5e-3,
        "batch_size": 4, "gradient_accumulation_steps": 1, "save_steps": 8,
    }
    raw.update(over)
    params = validate_params("finetune", raw, ResolveContext(lab.roots))
    assert isinstance(params, FinetuneParams)
    return params


async def _events(lab: Lab, job_id: str) -> list[tuple[str, dict[str, Any]]]:
    return [(e.type, e.data) for e in await lab.store.events_after(job_id, 0, 10_000)]


def _steps(events: list[tuple[str, dict[str, Any]]]) -> list[int]:
    return [d["step"] for t, d in events if t == "progress" and "step" in d]


async def test_finetune_loss_falls_events_in_order_outputs(tmp_path: Path, tiny_hf: Path) -> None:
    async with running_lab(tmp_path) as lab:
        params = _params(lab, tiny_hf, eval="qa.eval.jsonl", eval_steps=8, cpu_threads=1)
        job, _ = await lab.runner.submit("finetune", params)
        done = await wait_finished(lab.store, job.id, timeout=150)
        assert done.status == "succeeded", done.error
        events = await _events(lab, job.id)
    steps = _steps(events)
    assert steps == list(range(1, 17))
    progress = [d for t, d in events if t == "progress" and "step" in d]
    first, last = progress[0], progress[-1]
    assert last["loss"] < 0.5 * first["loss"], (first["loss"], last["loss"])
    for d in progress:
        assert d["total_steps"] == 16 and d["tokens_per_s"] > 0 and d["eta_s"] >= 0
        assert {"epoch", "lr", "elapsed_s", "loss"} <= d.keys()
    evals = [d for t, d in events if t == "metric" and "eval_loss" in d]
    assert [d["step"] for d in evals] == [8, 16] and evals[1]["eval_loss"] < evals[0]["eval_loss"]
    stages = [d["stage"] for t, d in events if t == "stage"]
    assert stages == ["loading", "training", "saving", "merging"]
    types = [t for t, _ in events]
    assert types[0] == "started" and types[-2:] == ["done", "status"]
    result = done.result or {}
    assert result["steps"] == 16 and result["resumed_from_step"] == 0
    assert result["cpu_threads"] == 1
    merged = Path(result["merged_path"])
    assert (merged / "model.safetensors").is_file() and (merged / "tokenizer.json").is_file()
    assert (merged / "chat_template.jinja").is_file() or "chat_template" in json.loads(
        (merged / "tokenizer_config.json").read_text())
    assert (Path(result["adapter_path"]) / "adapter_model.safetensors").is_file()
    assert [s for s, _ in complete_checkpoints(Path(result["output_dir"]) / "checkpoints")] == [8]


async def test_cancel_with_save_then_resume_continues(tmp_path: Path, tiny_hf: Path) -> None:
    async with running_lab(tmp_path) as lab:
        params = _params(lab, tiny_hf, max_steps=24, save_steps=1000, merge=False)
        job, _ = await lab.runner.submit("finetune", params)
        await wait_for(lab.store, job.id, lambda j: j.progress >= 3 / 24, timeout=120)
        await lab.runner.cancel(job.id, save=True)
        stopped = await wait_finished(lab.store, job.id)
        assert stopped.status == "cancelled"
        ckpt = newest_checkpoint(tmp_path / "outputs" / job.id / "checkpoints")
        assert ckpt is not None
        saved_step = json.loads((ckpt / "state.json").read_text())["step"]
        before = _steps(await _events(lab, job.id))
        assert saved_step == before[-1] >= 3
        _check_adapter_loads(lab.roots.models / "tiny-hf", ckpt)

        resumed = await lab.runner.resume(job.id)
        assert resumed.status == "queued"
        done = await wait_finished(lab.store, job.id, timeout=150)
        assert done.status == "succeeded", done.error
        assert done.attempt == 2
        assert (done.result or {})["resumed_from_step"] == saved_step
        steps = _steps(await _events(lab, job.id))
        assert steps == before + list(range(saved_step + 1, 25))
        with pytest.raises(Conflict):
            await lab.runner.resume(job.id)  # succeeded: nothing to resume


def _check_adapter_loads(base: Path, ckpt: Path) -> None:
    """A checkpoint is a usable LoRA adapter on its own."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), ckpt)
    assert sum(1 for n, _ in model.named_parameters() if "lora_" in n) > 0


async def test_cancel_without_save_and_kill_9(tmp_path: Path, tiny_hf: Path) -> None:
    async with running_lab(tmp_path) as lab:
        a = _params(lab, tiny_hf, max_steps=400, save_steps=1000, seed=1)
        b = _params(lab, tiny_hf, max_steps=400, save_steps=1000, seed=2)
        job_a, _ = await lab.runner.submit("finetune", a)
        await wait_for(lab.store, job_a.id, lambda j: j.progress > 0, timeout=120)
        await lab.runner.cancel(job_a.id)
        done_a = await wait_finished(lab.store, job_a.id)
        assert done_a.status == "cancelled"
        assert newest_checkpoint(tmp_path / "outputs" / job_a.id / "checkpoints") is None

        job_b, _ = await lab.runner.submit("finetune", b)
        running = await wait_for(lab.store, job_b.id, lambda j: j.progress > 0, timeout=120)
        assert running.pid is not None
        os.kill(running.pid, signal.SIGKILL)
        done_b = await wait_finished(lab.store, job_b.id)
        assert done_b.status == "failed" and "SIGKILL" in (done_b.error or "")


async def test_save_is_refused_for_kinds_that_cannot_resume(tmp_path: Path) -> None:
    from jobs.params import SleepParams

    async with running_lab(tmp_path) as lab:
        job, _ = await lab.runner.submit("sleep", SleepParams(steps=200, step_seconds=0.05))
        await wait_for(lab.store, job.id, lambda j: j.progress > 0)
        with pytest.raises(BadRequest) as exc:
            await lab.runner.cancel(job.id, save=True)
        assert exc.value.param == "save"
        await lab.runner.cancel(job.id)
        assert (await wait_finished(lab.store, job.id)).status == "cancelled"
        with pytest.raises(BadRequest):
            await lab.runner.resume(job.id)


def test_half_written_checkpoints_are_never_used(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    (root / "checkpoint-4").mkdir(parents=True)
    (root / "checkpoint-4" / "state.json").write_text("{}")
    (root / ".tmp-checkpoint-9-123").mkdir()  # killed while writing
    (root / ".tmp-checkpoint-9-123" / "state.json").write_text("{}")
    (root / "checkpoint-7").mkdir()  # no state file: incomplete
    assert newest_checkpoint(root) == root / "checkpoint-4"


def test_params_validation_names_the_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.jobsupport import make_roots

    roots = make_roots(tmp_path)
    (roots.models / "m").mkdir()
    (roots.models / "m" / "config.json").write_text("{}")
    write_chat_dataset(roots.datasets / "d.jsonl")
    ctx = ResolveContext(roots)
    ok = {"model": "m", "train": "d.jsonl"}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"lora_r": 0}, "params.lora_r"),
        ({"learning_rate": -1}, "params.learning_rate"),
        ({"batch_size": "x"}, "params.batch_size"),
        ({"lora_dropout": 1.0}, "params.lora_dropout"),
        ({"eval_steps": 5}, "params.eval_steps"),
        ({"train": "nope.jsonl"}, "params.train"),
        ({"model": "missing-dir"}, "params.model"),
        ({"model": "/etc"}, "params.model"),
        ({"target_modules": ["q_proj; rm"]}, "params.target_modules"),
        ({"bogus": 1}, "params.bogus"),
        ({"cpu_threads": -1}, "params.cpu_threads"),
        ({"merge": False, "export": {"quantize": "Q8_0"}}, "params.export"),
    ]
    for over, param in cases:
        with pytest.raises(ParamError) as exc:
            validate_params("finetune", {**ok, **over}, ctx)
        assert exc.value.param == param, (over, exc.value.message)
    params = validate_params("finetune", ok, ctx)
    assert isinstance(params, FinetuneParams) and params.lora_r == 16 and params.learning_rate == 2e-4

    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "peft" else real(name, *a))
    with pytest.raises(ParamError) as exc:
        validate_params("finetune", ok, ctx)
    assert exc.value.code == "train_extra_missing" and "gpuvisor[train]" in exc.value.message


def test_out_of_memory_becomes_a_clear_failure() -> None:
    import threading

    import torch

    from jobs.events import JobIO
    from jobs.finetune import JobHooks, _train

    class OomTrainer:
        class state:
            step = 6

        def train(self, hooks: Any) -> bool:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    params = FinetuneParams(model="m", train="t", batch_size=8, max_seq_len=4096)
    hooks = JobHooks(JobIO(), threading.Event())
    with pytest.raises(JobError) as exc:
        _train(hooks.io, OomTrainer(), hooks, params)  # type: ignore[arg-type]
    msg = str(exc.value)
    assert "out of memory at step 7" in msg and "batch_size 8" in msg and "max_seq_len 4096" in msg


async def test_cancel_and_resume_routes_validate(tmp_path: Path) -> None:
    import aiohttp

    from tests.test_jobs_routes import lab_server

    async with lab_server(tmp_path) as (lab, url), aiohttp.ClientSession() as http:
        r = await http.post(f"{url}/api/jobs", json={"kind": "sleep", "params": {"steps": 400}})
        job = await r.json()
        await wait_for(lab.store, job["id"], lambda j: j.progress > 0)
        bad = await http.post(f"{url}/api/jobs/{job['id']}/cancel?save=maybe")
        assert bad.status == 400 and (await bad.json())["error"]["param"] == "save"
        bad = await http.post(f"{url}/api/jobs/{job['id']}/cancel", json={"save": "yes"})
        assert bad.status == 400 and (await bad.json())["error"]["param"] == "save"
        refused = await http.post(f"{url}/api/jobs/{job['id']}/cancel", json={"save": True})
        assert refused.status == 400 and "cannot save" in (await refused.json())["error"]["message"]
        ok = await http.post(f"{url}/api/jobs/{job['id']}/cancel?save=false")
        assert ok.status == 200
        assert (await wait_finished(lab.store, job["id"])).status == "cancelled"
        r = await http.post(f"{url}/api/jobs/{job['id']}/resume")
        assert r.status == 400 and (await r.json())["error"]["param"] == "id"
        r = await http.post(f"{url}/api/jobs/job_missing/resume")
        assert r.status == 404
