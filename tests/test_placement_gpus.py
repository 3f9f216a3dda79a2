"""Placement of a model on simulated 1-, 2- and 4-GPU boxes, through the pool.

The GPUs are recorded readings; the memory fit is the real one, on GGUF
headers of a model whose file says 8 GiB (it needs about 10.6 GiB with its
KV cache at 4,096 tokens for 4 slots). Worker processes are not started here
(tests/test_gpu_serving.py starts real ones).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from supervisor.app import timing_from
from supervisor.config import Config, ModelSettings
from supervisor.errors import Unavailable
from supervisor.lab.gpu_setup import gpu_room
from supervisor.lab.lease import GpuLease, devices_from_readings
from supervisor.models.demo import write_tiny_gguf
from supervisor.models.devices import (
    MIB,
    DeviceReadError,
    GpuReading,
    RecordedSource,
    gpu_box,
)
from supervisor.models.gguf_info import read_gguf_info
from supervisor.models.library import ModelEntry
from supervisor.models.placement import GPU_RUNTIME_RESERVE, plan_load
from supervisor.models.settle import Settler
from supervisor.workers.handle import WorkerHandle, WorkerState
from supervisor.workers.pool import WorkerPool
from supervisor.workers.launcher import worker_argv, worker_environ
from tests import gguf_headers as hdr

GIB = 1024 * MIB


class Models:
    def __init__(self, entries: dict[str, ModelEntry]) -> None:
        self.entries = entries

    def entry(self, model_id: str) -> ModelEntry | None:
        return self.entries.get(model_id)

    def model_ids(self) -> list[str]:
        return list(self.entries)


def _entry(path: Path, model_id: str, size: int | None = None) -> ModelEntry:
    return ModelEntry(id=model_id, path=str(path), files=[str(path)],
                      size_bytes=path.stat().st_size if size is None else size, source="dir",
                      root=str(path.parent), mtime=0.0, info=read_gguf_info(path))


class Box:
    """A simulated box: the lease, the pool and the readings the test sets."""

    def __init__(self, tmp: Path, free_mib: list[int], *, headroom: float = 0.1) -> None:
        self.frames: list[list[GpuReading]] = [gpu_box(free_mib)]
        self.source = Replay(self.frames)
        self.settler = Settler(self.source, timeout=0.5, interval=0.01)
        self.lease = GpuLease(devices_from_readings(self.frames[0]), settler=self.settler)
        cfg = Config(n_ctx=4096, min_ctx=1024, load_wait_timeout=0.2, parallel=4)
        big = hdr.llama_gqa(tmp / "big.gguf")
        small = write_tiny_gguf(tmp / "small.gguf")
        wide = write_tiny_gguf(tmp / "wide.gguf", n_layer=8, n_embd=256, n_ff=1024, extra_tokens=0)
        models = Models({"big": _entry(big, "big", 8 * GIB), "small": _entry(small, "small"),
                         "wide": _entry(wide, "wide"),
                         "big2": _entry(big, "big2", 8 * GIB)})
        self.pool = WorkerPool(models, cfg, timing_from(cfg), tmp, tmp,  # type: ignore[arg-type]
                               admission=self.lease.worker_admission, device=self.lease.default_device,
                               gpus=gpu_room(self.lease, headroom), bookings=self.lease)
        self.lease.set_users(self.pool)

    def set_free(self, free_mib: list[int]) -> None:
        self.frames[:] = [gpu_box(free_mib)]

    def placement(self, model: str) -> dict[str, Any]:
        status = self.pool.status(model)
        assert status is not None and status["placement"] is not None
        placed: dict[str, Any] = status["placement"]
        return placed


class Replay(RecordedSource):
    """The latest frame the test set, read as often as asked."""

    def __init__(self, frames: list[list[GpuReading]]) -> None:
        super().__init__(frames)
        self.live = frames
        self.later: tuple[int, list[int]] | None = None

    def read(self) -> list[GpuReading]:
        self.reads += 1
        if self.later is not None and self.reads >= self.later[0]:
            self.live[:] = [gpu_box(self.later[1])]
            self.later = None
        return list(self.live[-1])

    def free_after(self, reads: int, free_mib: list[int]) -> None:
        """From the ``reads``-th further read on, the GPUs show ``free_mib``."""
        self.later = (self.reads + reads, free_mib)


@pytest.fixture
def box(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Box]:
    monkeypatch.setattr(WorkerHandle, "start", lambda self: None)
    return lambda free, **kw: Box(tmp_path, free, **kw)


def _need_mib(b: Box) -> int:
    entry = b.pool.models.entry("big")
    assert entry is not None
    fit = plan_load(entry, ModelSettings(), explicit_ctx=False, target_ctx=4096, min_ctx=1024,
                    free_bytes=64 * GIB, memory_kind="gpu", slots=4)
    assert fit is not None
    return fit.needed_bytes // MIB


async def test_one_gpu_box_places_on_it_with_headroom(box: Callable[..., Box]) -> None:
    b = box([16000])
    await b.pool.load("big")
    placed = b.placement("big")
    assert placed["mode"] == "single" and placed["devices"] == ["cuda:0"] and placed["indices"] == [0]
    assert placed["headroom"] == 0.1 and placed["usable_bytes"] == int(16000 * MIB * 0.9)
    spec = b.pool.handles[("big", False)].spec
    assert spec.gpu_indices == (0,) and spec.tensor_split == () and spec.devices == ("cuda:0",)
    await b.pool.stop_all()


async def test_two_gpus_the_one_with_most_free_memory_wins(box: Callable[..., Box]) -> None:
    b = box([12000, 16000])
    await b.pool.load("big")
    placed = b.placement("big")
    assert placed["mode"] == "single" and placed["devices"] == ["cuda:1"]
    assert placed["free_bytes"] == [16000 * MIB]
    # The worker sees exactly that GPU, under CUDA and ROCm alike.
    env = worker_environ(b.pool.handles[("big", False)].spec)
    assert env["CUDA_VISIBLE_DEVICES"] == env["ROCR_VISIBLE_DEVICES"] == "1"
    assert env["HIP_VISIBLE_DEVICES"] == "0"  # the first of those ROCr leaves
    assert b.lease.snapshot()["devices"][1]["workers"] == ["big"]
    await b.pool.stop_all()
    assert b.lease.snapshot()["devices"][1]["workers"] == []


async def test_headroom_sends_a_tight_fit_to_a_split(box: Callable[..., Box]) -> None:
    b = box([8000, 8000])
    need = _need_mib(b)
    # The bigger GPU holds the model without headroom, not with 10 % kept back.
    first = int(need / 0.95)
    b.set_free([6000, first])
    await b.pool.load("big")
    placed = b.placement("big")
    assert placed["mode"] == "split" and placed["devices"] == ["cuda:1", "cuda:0"]
    total = first + 6000
    assert placed["tensor_split"] == [round(first / total, 4), round(6000 / total, 4)]
    # Two runtimes: the second GPU costs one more reserve.
    assert placed["usable_bytes"] == int(first * MIB * 0.9) + int(6000 * MIB * 0.9) - GPU_RUNTIME_RESERVE
    spec = b.pool.handles[("big", False)].spec
    assert spec.gpu_indices == (1, 0) and worker_environ(spec)["CUDA_VISIBLE_DEVICES"] == "1,0"
    args = worker_argv(spec, b.pool.timing, ["--socket", "/tmp/s.sock"], Path("/tmp/s.e.sock"))
    assert args[args.index("--tensor-split") + 1] == ",".join(f"{x:.4f}" for x in placed["tensor_split"])
    await b.pool.stop_all()


async def test_headroom_is_a_setting(box: Callable[..., Box]) -> None:
    need = _need_mib(box([8000]))
    free = int(need / 0.95)  # the whole context fits in it, not with 10 % kept back
    for headroom, full in ((0.0, True), (0.1, False)):
        b = box([free], headroom=headroom)
        await b.pool.load("big")
        placed, fit = b.placement("big"), b.pool.fits[("big", False)]
        assert fit is not None and placed["usable_bytes"] == int(free * MIB * (1 - headroom))
        assert (fit.n_ctx == 4096) is full, (headroom, fit.n_ctx)
        await b.pool.stop_all()


async def test_four_gpus_take_the_fewest_that_fit_together(box: Callable[..., Box]) -> None:
    b = box([1000, 1000, 1000, 1000])
    need = _need_mib(b)
    # Three of these hold it with headroom and a reserve per extra GPU; two do not.
    share = int((need + 1024) / 2.7) + 200
    b.set_free([share - 100, share + 200, 2000, share])
    await b.pool.load("big")
    placed = b.placement("big")
    assert placed["mode"] == "split" and placed["devices"] == ["cuda:1", "cuda:3", "cuda:0"]
    assert abs(sum(placed["tensor_split"]) - 1.0) < 1e-3
    assert placed["tensor_split"][0] > placed["tensor_split"][2]
    await b.pool.stop_all()


async def test_too_big_for_every_gpu_offloads_layers_to_the_cpu(box: Callable[..., Box]) -> None:
    # A real model of about 33 MB with per-layer sizes: it can be split
    # between GPU and RAM. Both GPUs together hold the runtime and about 50 MiB.
    per_gpu = int((GPU_RUNTIME_RESERVE // MIB + 25) / 0.9) + 1
    b = box([per_gpu, per_gpu])
    await b.pool.load("wide", options=ModelSettings(n_ctx=1024))
    placed = b.placement("wide")
    fit = b.pool.fits[("wide", False)]
    assert fit is not None
    assert placed["mode"] == "offload" and placed["devices"] == ["cuda:0", "cuda:1"]
    assert fit.partial_offload and fit.host_bytes > 0
    await b.pool.stop_all()


async def test_a_job_on_one_gpu_leaves_inference_on_the_other(box: Callable[..., Box]) -> None:
    b = box([16000, 12000])
    chat = await b.pool.load("big")
    assert chat.spec.devices == ("cuda:0",)
    chat.state = WorkerState.READY
    # A finetune asks for one GPU: it gets the one without a worker.
    await asyncio.wait_for(b.lease.acquire_job("ft", "finetune", b.lease.preferred()[:1], 0), 2.0)
    assert b.lease.holds("ft") and ("big", False) in b.pool.handles
    assert await b.pool.load("big") is chat  # chat on cuda:0 is still admitted
    # A new model goes to the GPU no job holds, though the other has more free.
    b.set_free([30000, 40000])
    await b.pool.load("big2")
    assert b.placement("big2")["devices"] == ["cuda:0"]
    # With every GPU held, a load is refused with 503 naming the holder. (The
    # readings never show the evicted memory back: the settle wait gives up.)
    await asyncio.wait_for(b.lease.acquire_job("q", "quantize", ["cuda:0"], 0), 5.0)
    with pytest.raises(Unavailable) as refused:
        await b.pool.load("small")
    assert refused.value.status == 503 and refused.value.code == "gpu_busy"
    assert "job ft" in refused.value.message or "job q" in refused.value.message
    b.lease.release_job("ft")
    b.lease.release_job("q")
    await b.pool.stop_all()


async def test_a_job_on_the_workers_gpu_refuses_it_with_503_naming_the_job(box: Callable[..., Box]) -> None:
    b = box([16000, 12000])
    chat = await b.pool.load("big")
    chat.state = WorkerState.READY
    await asyncio.wait_for(b.lease.acquire_job("ft", "finetune", ["cuda:0"], 0), 5.0)
    # The job's device was vacated: the worker is gone, a new load goes to cuda:1.
    assert ("big", False) not in b.pool.handles
    await b.pool.load("big")
    assert b.placement("big")["devices"] == ["cuda:1"]
    await b.pool.stop_all()


async def test_eviction_waits_for_the_driver_to_free_the_memory(box: Callable[..., Box]) -> None:
    b = box([16000])
    first = await b.pool.load("big")
    first.state = WorkerState.READY
    # "big" holds ~10.6 GiB; the next load finds too little until it is evicted,
    # and the driver shows the memory back only some readings after the stop.
    b.set_free([5000])
    b.source.free_after(6, [16000])
    await asyncio.wait_for(b.pool.load("big2"), 5.0)
    assert b.source.later is None, "the load went ahead before the memory was back"
    assert ("big", False) not in b.pool.handles
    assert b.placement("big2")["free_bytes"] == [16000 * MIB]
    await b.pool.stop_all()


async def test_a_worker_still_starting_counts_as_using_its_plan(box: Callable[..., Box]) -> None:
    b = box([16000, 14000])
    await b.pool.load("big")  # still starting: the readings do not show its memory yet
    assert b.placement("big")["devices"] == ["cuda:0"]
    await b.pool.load("big2")
    # cuda:0 reads 16000 MiB free, but about 10.6 GiB of it is promised to "big".
    assert b.placement("big2")["devices"] == ["cuda:1"]
    await b.pool.stop_all()


async def test_unreadable_gpus_refuse_a_load_with_503(box: Callable[..., Box],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    b = box([16000])

    def broken() -> list[GpuReading]:
        raise DeviceReadError("nvidia-smi failed: driver/library version mismatch")

    monkeypatch.setattr(b.source, "read", broken)
    with pytest.raises(Unavailable) as refused:
        await b.pool.load("big")
    assert refused.value.status == 503 and refused.value.code == "gpu_unreadable"
    assert ("big", False) not in b.pool.handles


def test_the_worker_hands_the_split_to_the_engine(tmp_path: Path) -> None:
    import xllamacpp

    from worker.__main__ import parse_args
    from worker.engine_api import EngineOptions
    from worker.engine_params import engine_params

    args = parse_args(["--socket", "s", "--model", "m", "--tensor-split", "0.6250,0.3750"])
    assert args.tensor_split == (0.625, 0.375)
    opts = EngineOptions(str(tmp_path / "m.gguf"), 1024, -1, 1, False)
    opts.tensor_split = args.tensor_split
    engine = engine_params(opts)
    assert engine.tensor_split[:3] == [0.625, 0.375, 0.0]
    assert engine.split_mode == xllamacpp.llama_split_mode.LLAMA_SPLIT_MODE_LAYER
    with pytest.raises(SystemExit):
        parse_args(["--socket", "s", "--model", "m", "--tensor-split", "0,0"])
