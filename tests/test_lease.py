"""GpuLease: fairness, priority, cancellation, crash release, exclusivity."""

from __future__ import annotations

import asyncio
import logging
import random
from pathlib import Path

import pytest

from supervisor.lab.lease import (
    CPU,
    Device,
    GpuLease,
    cpu_device,
    detect_devices,
    parse_nvidia_smi,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeUsers:
    """Stands in for the worker pool: records vacate calls, can block them."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float, str]] = []
        self.gate: asyncio.Event | None = None

    async def vacate(self, device: str, drain_timeout: float, reason: str) -> None:
        self.calls.append((device, drain_timeout, reason))
        if self.gate is not None:
            await self.gate.wait()


def two_gpus() -> list[Device]:
    return [Device("cuda:0", "A", 0, 1000), Device("cuda:1", "B", 1, 1000)]


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_fifo_order_on_one_device() -> None:
    lease = GpuLease([cpu_device()])
    order: list[str] = []
    await lease.acquire_job("first", "t", [CPU], 0)
    tasks = [asyncio.create_task(lease.acquire_job(f"j{i}", "t", [CPU], 0)) for i in range(4)]
    await settle()
    lease.release_job("first")
    for _ in range(4):
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        tasks = [t for t in tasks if t not in done]
        holder = lease.snapshot()["devices"][0]["holder"]["job_id"]
        order.append(holder)
        lease.release_job(holder)
    assert order == ["j0", "j1", "j2", "j3"]


async def test_priority_beats_arrival() -> None:
    lease = GpuLease([cpu_device()])
    await lease.acquire_job("holder", "t", [CPU], 0)
    low = asyncio.create_task(lease.acquire_job("low", "t", [CPU], 0))
    await settle()
    high = asyncio.create_task(lease.acquire_job("high", "t", [CPU], 5))
    await settle()
    assert [w["job_id"] for w in lease.snapshot()["waiters"]] == ["high", "low"]
    lease.release_job("holder")
    await high
    assert not low.done()
    lease.release_job("high")
    await low
    assert lease.holds("low")


async def test_cancelled_waiter_leaves_queue_cleanly() -> None:
    lease = GpuLease([cpu_device()])
    await lease.acquire_job("holder", "t", [CPU], 0)
    gone = asyncio.create_task(lease.acquire_job("gone", "t", [CPU], 9))
    nxt = asyncio.create_task(lease.acquire_job("next", "t", [CPU], 0))
    await settle()
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert [w["job_id"] for w in lease.snapshot()["waiters"]] == ["next"]
    lease.release_job("holder")
    await nxt
    assert lease.holds("next")


async def test_cancel_while_draining_frees_device() -> None:
    users = FakeUsers()
    users.gate = asyncio.Event()
    lease = GpuLease([cpu_device()], drain_timeout=7.0)
    lease.set_users(users)
    t = asyncio.create_task(lease.acquire_job("j", "quantize", [CPU], 0))
    await settle()
    assert users.calls and users.calls[0][:2] == (CPU, 7.0)
    assert "being freed for job j (quantize)" in (lease.worker_admission(CPU) or "")
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    assert lease.worker_admission(CPU) is None
    assert lease.snapshot()["waiters"] == []


async def test_worker_admission_while_held_and_after() -> None:
    users = FakeUsers()
    lease = GpuLease([cpu_device()])
    lease.set_users(users)
    assert lease.worker_admission(CPU) is None
    await lease.acquire_job("job_ab12", "quantize", [CPU], 0)
    assert lease.worker_admission(CPU) == "device cpu is held by job job_ab12 (quantize)"
    assert lease.snapshot()["devices"][0]["why"] is not None
    lease.release_job("job_ab12")
    assert lease.worker_admission(CPU) is None
    assert lease.worker_admission("cuda:7") is not None


async def test_release_on_crash() -> None:
    lease = GpuLease([cpu_device()])

    async def crashing_job() -> None:
        async with lease.job("crash", "t", [CPU], 0):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        await crashing_job()
    assert lease.worker_admission(CPU) is None
    await asyncio.wait_for(lease.acquire_job("after", "t", [CPU], 0), 1)


async def test_multi_device_request_is_not_starved() -> None:
    lease = GpuLease(two_gpus())
    await lease.acquire_job("a", "t", ["cuda:0"], 0)
    both = asyncio.create_task(lease.acquire_job("both", "t", ["cuda:0", "cuda:1"], 0))
    await settle()
    # cuda:1 is free, but the earlier waiter wants it: a later one must queue.
    late = asyncio.create_task(lease.acquire_job("late", "t", ["cuda:1"], 0))
    await settle()
    assert not late.done()
    lease.release_job("a")
    await both
    lease.release_job("both")
    await late


async def test_waited_time_uses_injected_clock() -> None:
    clock = FakeClock()
    lease = GpuLease([cpu_device()], clock=clock)
    await lease.acquire_job("h", "t", [CPU], 0)
    w = asyncio.create_task(lease.acquire_job("w", "t", [CPU], 0))
    await settle()
    clock.now += 12.5
    assert lease.snapshot()["waiters"][0]["waited_s"] == 12.5
    w.cancel()
    with pytest.raises(asyncio.CancelledError):
        await w


async def test_no_two_holders_overlap_randomized() -> None:
    rng = random.Random(1234)
    devices = [Device(f"cuda:{i}", "g", i) for i in range(3)]
    lease = GpuLease(devices)
    users = FakeUsers()
    lease.set_users(users)
    holding: dict[str, set[str]] = {}
    violations: list[str] = []
    finished = 0

    async def one(i: int) -> None:
        nonlocal finished
        want = rng.sample([d.id for d in devices], rng.randint(1, 2))
        job = f"j{i}"
        try:
            await lease.acquire_job(job, "t", want, rng.randint(0, 3))
        except asyncio.CancelledError:
            return
        for other, devs in holding.items():
            if devs & set(want):
                violations.append(f"{job} overlaps {other}")
        holding[job] = set(want)
        for _ in range(rng.randint(0, 4)):
            await asyncio.sleep(0)
        del holding[job]
        lease.release_job(job)
        finished += 1

    tasks = [asyncio.create_task(one(i)) for i in range(300)]
    for t in rng.sample(tasks, 60):
        await asyncio.sleep(0)
        t.cancel()
    await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 20)
    assert violations == []
    assert finished >= 200
    assert lease.snapshot()["waiters"] == []
    assert all(lease.worker_admission(d.id) is None for d in devices)


def test_parse_nvidia_smi() -> None:
    text = "0, NVIDIA H100 80GB HBM3, 81559\n1, NVIDIA RTX 4090, 24564 MiB\n"
    devs = parse_nvidia_smi(text)
    assert [d.id for d in devs] == ["cuda:0", "cuda:1"]
    assert devs[0].memory_total_mib == 81559 and devs[1].memory_total_mib == 24564
    assert devs[1].name == "NVIDIA RTX 4090"


async def test_detect_falls_back_to_cpu() -> None:
    assert [d.id for d in await detect_devices(command=["false"])] == [CPU]
    assert [d.id for d in await detect_devices(command=["/nonexistent-tool-x"])] == [CPU]
    assert [d.id for d in await detect_devices(["cuda:1"])] == ["cuda:1"]


async def test_detect_says_why_it_fell_back_to_cpu(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    def said(level: int) -> list[str]:
        out = [r.getMessage() for r in caplog.records if r.name == "gpuvisor.lease" and r.levelno == level]
        caplog.clear()
        return out

    caplog.set_level(logging.DEBUG, logger="gpuvisor.lease")
    # Not installed: the usual machine without an NVIDIA GPU, said at debug level only.
    await detect_devices(command=[str(tmp_path / "no-such-smi")])
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert said(logging.WARNING) == [] and any("no-such-smi is not installed" in m for m in debug), debug
    await detect_devices(command=["false"])
    assert said(logging.WARNING) == ["false exited with status 1: the lease has the CPU"]
    not_runnable = tmp_path / "smi"
    not_runnable.write_text("not a program")
    await detect_devices(command=[str(not_runnable)])
    (warning,) = said(logging.WARNING)
    assert warning.startswith(f"cannot run {not_runnable} (") and "Permission denied" in warning
    devices = await detect_devices(command=["sleep", "30"], timeout=0.2)
    assert [d.id for d in devices] == [CPU]
    assert said(logging.WARNING) == ["sleep did not answer within 0.2 s: the lease has the CPU"]
