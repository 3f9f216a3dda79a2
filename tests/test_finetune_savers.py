"""The fine-tune's memory savers and its memory estimate.

Gradient checkpointing is on by default and trains to the same gradients;
a 4-bit base (QLoRA) is refused where it cannot run, with the reason; the
estimate read from the model's files matches what the model really holds,
and the job logs it beside the measured peak.
"""

from __future__ import annotations

import importlib.util
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

pytest.importorskip("peft", reason="needs the train extra")

from jobs.errors import ParamError
from jobs.events import JobIO
from jobs.finetune_memory import estimate_memory
from jobs.finetune_params import FinetuneParams
from jobs.kinds import validate_params
from jobs.params import ResolveContext
from supervisor.lab.lease import GpuLease, device_from_id
from tests.jobsupport import Lab, make_roots, running_lab, wait_finished
from tests.test_finetune_ddp import gpu_lab
from tests.tiny_hf import build_tiny_model, copy_model, write_chat_dataset

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def one_torch_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("hf") / "tiny-llama")


def _raw(**over: Any) -> dict[str, Any]:
    return {"model": "tiny-hf", "train": "qa.train.jsonl", "max_steps": 2, "batch_size": 4,
            "gradient_accumulation_steps": 1, "save_steps": 1000, "merge": False, **over}


def _setup(lab_roots: Any, model: Path) -> None:
    if not (lab_roots.models / "tiny-hf").exists():
        copy_model(model, lab_roots.models)
    write_chat_dataset(lab_roots.datasets / "qa.train.jsonl")


@pytest.fixture
def with_bitsandbytes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The parent believes bitsandbytes is installed (the job process does not)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "bitsandbytes" else real(name, *a))
    yield


# ------------------------------------------------------------ QLoRA refused


async def test_qlora_on_the_cpu_is_refused_at_submit(tmp_path: Path, tiny_hf: Path) -> None:
    import aiohttp

    from tests.test_jobs_routes import lab_server

    async with lab_server(tmp_path) as (lab, url), aiohttp.ClientSession() as http:
        _setup(lab.roots, tiny_hf)
        r = await http.post(f"{url}/api/jobs", json={"kind": "finetune", "params": _raw(load_in_4bit=True)})
        body = await r.json()
        assert r.status == 400, body
        err = body["error"]
        assert err["param"] == "params.load_in_4bit" and err["code"] == "needs_gpu"
        assert "needs a CUDA GPU" in err["message"] and "CPU" in err["message"]
        assert (await lab.store.list_jobs(limit=10)).jobs == []


def test_qlora_without_bitsandbytes_is_refused(tmp_path: Path, tiny_hf: Path) -> None:
    if importlib.util.find_spec("bitsandbytes") is not None:
        pytest.skip("bitsandbytes is installed here")
    roots = make_roots(tmp_path)
    _setup(roots, tiny_hf)
    params = validate_params("finetune", _raw(load_in_4bit=True), ResolveContext(roots))
    with pytest.raises(ParamError) as exc:
        params.devices(["cuda:0", "cuda:1"])
    assert exc.value.param == "params.load_in_4bit" and exc.value.code == "bitsandbytes_missing"
    assert "pip install bitsandbytes" in exc.value.message


async def test_qlora_on_a_gpu_torch_cannot_use_fails_the_job_with_the_reason(
    tmp_path: Path, tiny_hf: Path, with_bitsandbytes: None
) -> None:
    # The lease lists a GPU, but this torch has no CUDA: known only in the job.
    async with gpu_lab(tmp_path, gpus=1) as lab:
        _setup(lab.roots, tiny_hf)
        params = validate_params("finetune", _raw(load_in_4bit=True), ResolveContext(lab.roots))
        assert params.devices(lab.lease.devices) == ["cuda:0"]
        job, _ = await lab.runner.submit("finetune", params)
        done = await wait_finished(lab.store, job.id, timeout=90)
    assert done.status == "failed"
    assert "load_in_4bit (QLoRA) needs a CUDA GPU" in (done.error or "")
    assert "sees no CUDA device" in (done.error or "")


# ------------------------------------------------------------ checkpointing


async def _run(lab: Lab, **over: Any) -> tuple[dict[str, Any], list[str], dict[str, Any]]:
    params = validate_params("finetune", _raw(**over), ResolveContext(lab.roots))
    job, _ = await lab.runner.submit("finetune", params)
    done = await wait_finished(lab.store, job.id, timeout=90)
    assert done.status == "succeeded", done.error
    logs = [e.data["message"] for e in await lab.store.events_after(job.id, 0, 1000) if e.type == "log"]
    return done.result or {}, logs, done.params


async def test_checkpointing_is_on_by_default_and_can_be_turned_off(tmp_path: Path, tiny_hf: Path) -> None:
    async with running_lab(tmp_path) as lab:
        _setup(lab.roots, tiny_hf)
        result, logs, stored = await _run(lab, cpu_threads=1)
        assert stored["gradient_checkpointing"] is True and stored["load_in_4bit"] is False
        assert result["gradient_checkpointing"] is True
        assert any(m.startswith("gradient checkpointing: on") for m in logs), logs
        # The estimate and the measured peak, side by side in the log and the result.
        assert any(m.startswith("memory estimate per device: ") for m in logs), logs
        peak = next(m for m in logs if "memory on cpu: peak" in m)
        assert "RSS peak" in peak and "estimate" in peak
        memory = result["memory"]
        assert memory["measured_by"] == "RSS peak" and memory["peak_bytes"] >= memory["before_load_bytes"] > 0
        assert memory["estimate_bytes"] > 0

        result, logs, stored = await _run(lab, gradient_checkpointing=False, output_name="no-gc")
        assert stored["gradient_checkpointing"] is False and result["gradient_checkpointing"] is False
        assert any(m.startswith("gradient checkpointing: off") for m in logs), logs


def test_checkpointing_recomputes_the_same_gradients(tmp_path: Path, tiny_hf: Path) -> None:
    import torch

    from jobs.finetune_data import collate, encode_all, read_chat_jsonl
    from jobs.finetune_model import load_model, load_tokenizer

    roots = make_roots(tmp_path)
    _setup(roots, tiny_hf)
    params = validate_params("finetune", _raw(), ResolveContext(roots))
    assert isinstance(params, FinetuneParams)
    quiet = JobIO(stdin=io.BytesIO(), stdout=io.BytesIO())
    tok = load_tokenizer(quiet, Path(params.model))
    batch = collate(encode_all(tok, read_chat_jsonl(Path(params.train)), 64).examples[:4], 0)
    grads, kept = [], []
    for on in (True, False):
        torch.manual_seed(0)
        model, checkpointing = load_model(quiet, msgspec.structs.replace(params, gradient_checkpointing=on),
                                          Path(params.model), torch.device("cpu"))
        assert checkpointing is on
        model.train()
        saved = [0]

        def pack(t: torch.Tensor, saved: list[int] = saved) -> torch.Tensor:
            saved[0] += t.numel() * t.element_size()
            return t

        # What the forward pass keeps for the backward one (a checkpointed
        # layer keeps its input only, out of these hooks' sight).
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         labels=batch["input_ids"], use_cache=False).loss
        loss.backward()
        kept.append(saved[0])
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    assert kept[0] < 0.5 * kept[1], kept
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, g in grads[0].items():
        assert torch.allclose(g, grads[1][name], atol=1e-6), name


# ------------------------------------------------------------ the estimate


def test_estimate_counts_what_the_model_holds(tmp_path: Path, tiny_hf: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    roots = make_roots(tmp_path)
    _setup(roots, tiny_hf)
    params = validate_params("finetune", _raw(), ResolveContext(roots))
    assert isinstance(params, FinetuneParams)
    model_dir = Path(params.model)
    est = estimate_memory(model_dir, params, 4)
    assert est is not None
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    held = sum(p.numel() * p.element_size() for p in base.parameters())
    assert est.weights_bytes == held
    lora = get_peft_model(base, LoraConfig(r=params.lora_r, target_modules=params.target_modules))
    trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert est.adapter_bytes == trainable * 16  # fp32 weight, gradient, two Adam moments

    # Checkpointing keeps less; a 4-bit base weighs less; a longer batch costs more.
    off = estimate_memory(model_dir, msgspec.structs.replace(params, gradient_checkpointing=False), 4)
    q4 = estimate_memory(model_dir, msgspec.structs.replace(params, load_in_4bit=True), 2)
    short = estimate_memory(model_dir, params, 4, seq_len=64)
    assert off is not None and q4 is not None and short is not None
    assert off.activations_bytes > est.activations_bytes
    assert short.total_bytes < est.total_bytes and est.tokens_per_micro_batch == 4 * params.max_seq_len
    # Only the decoder's linear weights are 4-bit (embeddings and norms stay fp32).
    assert q4.weights_bytes < est.weights_bytes
    assert estimate_memory(tmp_path, params, 4) is None  # no safetensors: no estimate


def test_a_multi_gpu_booking_needs_devices_the_machine_has() -> None:
    params = FinetuneParams(model="m", train="t", gpus=2)
    assert params.world_size() == 2
    assert params.devices(GpuLease([device_from_id("cuda:0"), device_from_id("cuda:1")]).devices) == [
        "cuda:0", "cuda:1"]
    with pytest.raises(ParamError):
        params.devices(["cpu"])
    assert FinetuneParams(model="m", train="t", gpu_ids=["1", "cuda:1", "0"]).world_size() == 2
