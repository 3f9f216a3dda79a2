"""LoRA adapters in a real worker process: one that fits is held and applied
per request; one the engine refuses costs only itself, never the worker nor
the other adapters given with it."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from pathlib import Path

import pytest

pytest.importorskip("peft", reason="needs the train extra")

from jobs.hf_convert import convert
from jobs.lora_export import convert_adapter
from tests.lora_support import engine_refused_copy, random_adapter, truncated_copy
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
    convert_adapter(random_adapter(hf, tmp / "good2", seed=3), hf, tmp / "good2.gguf", "F16", "good2")
    return {"base": tmp / "base.gguf", "good": tmp / "good.gguf", "bad": tmp / "bad.gguf",
            "good2": tmp / "good2.gguf",
            "refused": engine_refused_copy(tmp / "good.gguf", tmp / "refused.gguf"),
            "truncated": truncated_copy(tmp / "good.gguf", tmp / "truncated.gguf")}


PROMPT = "user What colour"


def _spawn(model: Path, adapters: list[Path]) -> AbstractAsyncContextManager[tuple[Worker, p.Ready]]:
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


async def test_bad_adapters_are_refused_alone_and_the_others_are_held(files: dict[str, Path]) -> None:
    """A truncated file (found from its header) and one only the engine
    refuses, given first and amid two good ones: the good two are held and
    apply, each refused one is named with why, and asking for it says why."""
    async with _spawn(files["base"], []) as (plain, _):
        base_text, _ = await _generate(plain)
    async with _spawn(files["base"], [files["good"]]) as (one, _):
        good_text, _ = await _generate(one, str(files["good"]))
    given = [files["truncated"], files["good"], files["refused"], files["good2"]]
    async with _spawn(files["base"], given) as (worker, hello):
        assert hello.facts.adapters == [str(files["good"]), str(files["good2"])]
        refused = hello.facts.refused_adapters
        assert set(refused) == {str(files["truncated"]), str(files["refused"])}
        # The worker's reader finds the data short before the layout is looked at.
        assert "cannot read it" in refused[str(files["truncated"])]
        assert "engine refused it" in refused[str(files["refused"])]
        assert "refused.gguf" in hello.facts.adapter_error and "truncated.gguf" in hello.facts.adapter_error
        text, done = await _generate(worker, str(files["good"]))
        assert isinstance(done, p.Done) and text == good_text != base_text
        other, done = await _generate(worker, str(files["good2"]))
        assert isinstance(done, p.Done) and other not in (base_text, good_text)
        assert (await _generate(worker))[0] == base_text
        _, asked = await _generate(worker, str(files["refused"]))
        assert isinstance(asked, p.Error) and asked.code == "adapter_unavailable"
        assert "engine refused it" in asked.message
