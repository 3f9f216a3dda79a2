"""The device layer without GPUs: recorded readings, pinning, the settle wait,
and the lease's per-device arbitration on simulated 1-, 2- and 4-GPU boxes."""

from __future__ import annotations

import asyncio

import pytest

from jobs.errors import ParamError
from jobs.params import SleepParams
from supervisor.lab.gpu_setup import build_lease
from supervisor.lab.lease import CPU, GpuLease, devices_from_readings
from supervisor.models.devices import (
    MIB,
    DeviceReadError,
    GpuReading,
    RecordedSource,
    SmiSource,
    gpu_box,
    parse_gpu_csv,
    pinned_environ,
)
from supervisor.models.settle import Settler

# Recorded from `nvidia-smi --query-gpu=index,uuid,name,memory.free,memory.total
# --format=csv,noheader,nounits` on a two-GPU box (uuids shortened).
SMI_TWO = """\
0, GPU-1b2c3d4e-aaaa, NVIDIA GeForce RTX 4090, 20311, 24564
1, GPU-9f8e7d6c-bbbb, NVIDIA RTX A6000, 46990, 49140
"""


class FakeTime:
    """A clock and a sleep that advances it: settle waits never really sleep."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


class Users:
    def __init__(self) -> None:
        self.vacated: list[str] = []

    async def vacate(self, device: str, drain_timeout: float, reason: str) -> None:
        self.vacated.append(device)


def test_recorded_nvidia_smi_output_is_read_per_gpu() -> None:
    gpus = parse_gpu_csv(SMI_TWO)
    assert [(g.index, g.name, g.free_bytes // MIB, g.total_bytes // MIB) for g in gpus] == [
        (0, "NVIDIA GeForce RTX 4090", 20311, 24564), (1, "NVIDIA RTX A6000", 46990, 49140)]
    assert [d.id for d in devices_from_readings(gpus)] == ["cuda:0", "cuda:1"]
    with pytest.raises(DeviceReadError):
        parse_gpu_csv("0, GPU-x, name, lots, 24564")


def test_the_parents_visible_devices_limit_the_gpus() -> None:
    assert [g.index for g in SmiSource(lambda: SMI_TWO, {"CUDA_VISIBLE_DEVICES": "1"}).read()] == [1]
    assert [g.index for g in SmiSource(lambda: SMI_TWO, {"CUDA_VISIBLE_DEVICES": "GPU-9f8e"}).read()] == [1]
    assert SmiSource(lambda: SMI_TWO, {"CUDA_VISIBLE_DEVICES": ""}).read() == []


def test_no_driver_reads_as_no_gpu_and_a_failing_one_is_an_error() -> None:
    def missing() -> str:
        raise FileNotFoundError("nvidia-smi")

    def broken() -> str:
        raise OSError("driver/library version mismatch")

    assert SmiSource(missing, {}).read() == []
    with pytest.raises(DeviceReadError):
        SmiSource(broken, {}).read()


async def test_a_box_without_gpus_has_the_one_cpu_device() -> None:
    lease = await build_lease(source=RecordedSource([[]]))
    assert lease.devices == [CPU] and lease.gpu_indices(lease.devices) == []


def test_pinning_sets_cuda_hip_and_rocr_to_exactly_the_devices() -> None:
    env = pinned_environ([3, 1])
    assert env["CUDA_VISIBLE_DEVICES"] == env["ROCR_VISIBLE_DEVICES"] == "3,1"
    # HIP counts within what ROCr left (tests/test_amd_gpus.py).
    assert env["HIP_VISIBLE_DEVICES"] == "0,1"
    # The lease numbers GPUs as nvidia-smi does (PCI bus order); CUDA must agree.
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert pinned_environ([])["CUDA_VISIBLE_DEVICES"] == ""


async def test_settle_waits_until_the_driver_shows_the_memory_freed() -> None:
    t = FakeTime()
    # The worker exited; the driver frees its 10 GiB over three readings.
    source = RecordedSource([gpu_box([2000, 9000]), gpu_box([2000, 9000]), gpu_box([6000, 9000]),
                             gpu_box([12240, 9000])])
    settler = Settler(source, timeout=10.0, interval=0.5, clock=t.clock, sleep=t.sleep)
    settler.expect_freed(gpu_box([2000, 9000]), {0: 10240 * MIB})
    got = await settler.wait()
    assert got.settled and source.reads == 4 and t.slept == [0.5, 0.5, 0.5]
    # Met once: a second wait reads nothing.
    assert (await settler.wait()).settled and source.reads == 4


async def test_settle_is_bounded() -> None:
    t = FakeTime()
    source = RecordedSource([gpu_box([2000])])  # the memory never comes back
    settler = Settler(source, timeout=3.0, interval=1.0, clock=t.clock, sleep=t.sleep)
    settler.expect(0, 8000 * MIB)
    got = await settler.wait()
    assert not got.settled and got.pending == [0] and got.waited_s == 3.0
    assert settler.pending() == []  # given up: the next placement measures what is there


async def test_a_jobs_memory_is_expected_back_before_the_next_placement() -> None:
    t = FakeTime()
    # Before the job: 20 GiB free on cuda:1; while it runs 4 GiB; after it ends
    # the driver needs two more readings to show it free again.
    source = RecordedSource([gpu_box([24000, 20480])] + [gpu_box([24000, 4096])] * 2
                            + [gpu_box([24000, 20000])])
    settler = Settler(source, timeout=10.0, interval=0.5, clock=t.clock, sleep=t.sleep)
    lease = GpuLease(devices_from_readings(gpu_box([24000, 20480])), settler=settler)
    await lease.acquire_job("j1", "finetune", ["cuda:1"], 0)
    assert settler.pending() == [] and source.reads == 1  # measured once vacated
    lease.release_job("j1")
    assert settler.pending() == [1]
    # Within 5 % of the total of what it was: 20000 MiB of 20480 will do.
    assert (await settler.wait([1])).settled and source.reads == 4


async def test_jobs_on_different_gpus_never_block_each_other() -> None:
    lease = GpuLease(devices_from_readings(gpu_box([1000, 2000, 3000, 4000])))
    users = Users()
    lease.set_users(users)
    await lease.acquire_job("a", "finetune", ["cuda:0"], 0)
    # cuda:1 is free: a second job gets it at once, while the first holds cuda:0.
    await asyncio.wait_for(lease.acquire_job("b", "quantize", ["cuda:1", "cuda:2"], 0), 1.0)
    assert users.vacated == ["cuda:0", "cuda:1", "cuda:2"]
    assert lease.worker_admission("cuda:3") is None
    assert "held by job a" in (lease.worker_admission("cuda:0") or "")
    assert "held by job b" in (lease.worker_admission("cuda:2") or "")
    # A third job for cuda:0 waits in line for that device alone.
    waiting = asyncio.create_task(lease.acquire_job("c", "finetune", ["cuda:0"], 0))
    await asyncio.sleep(0)
    snap = {d["id"]: d for d in lease.snapshot(gpu_box([1000, 2000, 3000, 4000]))["devices"]}
    assert snap["cuda:0"]["holder"]["job_id"] == "a" and snap["cuda:0"]["waiters"] == ["c"]
    assert snap["cuda:1"]["waiters"] == [] and snap["cuda:3"]["state"] == "free"
    assert snap["cuda:3"]["memory"] == {"free_mib": 4000, "total_mib": 24576}
    lease.release_job("a")
    await asyncio.wait_for(waiting, 1.0)
    assert lease.holds("c") and lease.holds("b")


async def test_a_count_of_gpus_takes_the_least_used_first() -> None:
    lease = GpuLease(devices_from_readings(gpu_box([1000, 2000, 3000, 4000])))
    lease.book_worker("chat", ["cuda:0"])
    lease.book_worker("big", ["cuda:1", "cuda:2"])
    await lease.acquire_job("a", "finetune", ["cuda:3"], 0)
    # cuda:3 is held; of the rest, those with fewer workers come first.
    assert lease.preferred() == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    lease.unbook_worker("chat")
    assert SleepParams(gpus=1).devices(lease.preferred()) == ["cuda:0"]
    assert SleepParams(gpus=2).devices(lease.preferred()) == ["cuda:0", "cuda:1"]
    snap = {d["id"]: d for d in lease.snapshot()["devices"]}
    assert snap["cuda:2"]["workers"] == ["big"] and snap["cuda:0"]["workers"] == []


def test_named_or_counted_gpus_the_machine_lacks_are_refused() -> None:
    available = ["cuda:0", "cuda:1"]
    assert SleepParams(gpu_ids=["1"]).devices(available) == ["cuda:1"]
    assert SleepParams(gpu_ids=["cuda:1", "cuda:0"]).devices(available) == ["cuda:1", "cuda:0"]
    with pytest.raises(ParamError) as named:
        SleepParams(gpu_ids=["cuda:7"]).devices(available)
    assert named.value.param == "params.gpu_ids"
    with pytest.raises(ParamError) as counted:
        SleepParams(gpus=3).devices(available)
    assert counted.value.param == "params.gpus"
    # On a machine without GPUs the one device is ``cpu``, as before.
    assert SleepParams().devices([CPU]) == [CPU]


class Unreadable(RecordedSource):
    """A driver that stopped answering after the first reading."""

    def read(self) -> list[GpuReading]:
        self.reads += 1
        if self.reads > 1:
            raise DeviceReadError("nvidia-smi failed: Unable to determine the device handle")
        return gpu_box([8000, 8000])


async def test_a_job_still_runs_when_the_gpus_cannot_be_read() -> None:
    source = Unreadable([[]])
    lease = GpuLease(devices_from_readings(source.read()), settler=Settler(source, timeout=1.0))
    await asyncio.wait_for(lease.acquire_job("j", "finetune", ["cuda:0"], 0), 1.0)
    assert lease.holds("j")
    lease.release_job("j")
    assert lease.settler is not None and lease.settler.pending() == []  # nothing to wait for
