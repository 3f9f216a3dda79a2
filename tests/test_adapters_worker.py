"""LoRA adapters in a real worker process: one that fits is held and applied
per request; one the engine refuses costs only itself, never the worker."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from pathlib import Path

import pytest

pytest.importorskip("peft", reason="needs the train extra")

from jobs.hf_convert import convert
from jobs.lora_export import convert_adapter
from tests.lora_support import random_adapter
from tests.tiny_hf import build_tiny_model
from tests.worker_harness import Worker, spawn_worker
from worker import protocol as p

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("lora-worker")
    hf = build_tiny_model(tmp / "tiny-hf")
    convert(hf, tmp / "base.gguf", "F16", "tiny-hf")
    convert_adapter(random_adapter(hf, tmp / "good", seed=1), hf, tmp / "good.gguf", "F16", "good")
    other = build_tiny_model(tmp / "other", intermediate_size=96)
    convert_adapter(random_adapter(other, tmp / "bad", seed=2), other, tmp / "bad.gguf", "F16", "bad")
    return {"base": tmp / "base.gguf", "good": tmp / "good.gguf", "bad": tmp / "bad.gguf"}


PROMPT = "user What colour"


def _spawn(model: Path, adapters: list[Path]) -> AbstractAsyncContextManager[tuple[Worker, p.Hello]]:
    return spawn_worker(model, "--parallel", "2", *(a for path in adapters for a in ("--lora", str(path))),
                        n_ctx=256)


async def _generate(worker: Worker, adapter: str = "", scale: float = 1.0) -> tuple[str, p.Done | p.Error]:
    return await worker.generate(prompt=PROMPT, adapter=adapter, adapter_scale=scale)


async def test_held_adapter_applies_per_request(files: dict[str, Path]) -> None:
    async with _spawn(files["base"], []) as (plain, _):
        base_text, _ = await _generate(plain)
    async with _spawn(files["base"], [files["good"]]) as (worker, hello):
        assert hello.facts.adapters == [str(files["good"])] and not hello.facts.adapter_error
        with_adapter, done = await _generate(worker, str(files["good"]))
        assert isinstance(done, p.Done) and with_adapter != base_text
        assert (await _generate(worker))[0] == base_text
        assert (await _generate(worker, str(files["good"]), 0.0))[0] == base_text
        _, unknown = await _generate(worker, str(files["bad"]))
        assert isinstance(unknown, p.Error) and unknown.code == "adapter_unavailable"


async def test_an_adapter_the_engine_refuses_leaves_the_base_serving(files: dict[str, Path]) -> None:
    async with _spawn(files["base"], []) as (plain, _):
        base_text, _ = await _generate(plain)
    async with _spawn(files["base"], [files["bad"]]) as (worker, hello):
        assert hello.facts.adapters == [] and hello.facts.adapter_error
        text, done = await _generate(worker)
        assert isinstance(done, p.Done) and text == base_text
        _, refused = await _generate(worker, str(files["bad"]))
        assert isinstance(refused, p.Error) and refused.code == "adapter_unavailable"
