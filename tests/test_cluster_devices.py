"""Devices of a cluster's nodes, apart from Ray: the lease's books per node,
placement on one node with room, a node's name and readings, and the node
watch's join and leave (tests/test_ray_cluster.py runs them on a real cluster).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest

from supervisor.config import ModelSettings
from supervisor.errors import Unavailable
from supervisor.lab.lease import GpuLease, cpu_device
from supervisor.models.devices import MIB, GpuReading
from supervisor.models.gguf_info import read_gguf_info
from supervisor.models.gpu_place import GpuPlacement, place_on_nodes
from supervisor.models.gpu_reading import device_node
from supervisor.models.library import ModelEntry
from supervisor.models.memfit import ContextDecision, DoesNotFit
from supervisor.models.placement import GPU_RUNTIME_RESERVE, plan_load
from supervisor.models.slots import SlotAsk
from supervisor.workers.cluster_nodes import ClusterNodes, node_readings
from supervisor.workers.gpu_room import GpuRoom
from supervisor.workers.node_agent import NodeAgent, node_gpu_source
from supervisor.workers.node_loss import NodeLoss
from supervisor.workers.ray_launcher import ClusterError, ClusterNode, _name_for
from supervisor.workers.room import Room
from tests import gguf_headers as hdr

GIB = 1024 * MIB


def _gpu(node: str, index: int, free_gib: float, total_gib: int = 24) -> GpuReading:
    return GpuReading(index=index, uuid=f"GPU-{node}-{index}", name="Sim", free_bytes=int(free_gib * GIB),
                      total_bytes=total_gib * GIB, node=node)


def test_device_ids_name_their_node_and_this_machine_stays_plain() -> None:
    assert _gpu("node-a", 1, 1).device_id == "node-a/cuda:1"
    assert GpuReading(index=0, uuid="u", name="n", free_bytes=1, total_bytes=2).device_id == "cuda:0"
    assert device_node("node-a/cuda:1") == "node-a" and device_node("cuda:1") == "" and device_node("cpu") == ""


def test_the_lease_books_a_nodes_devices_while_it_is_there() -> None:
    lease = GpuLease([cpu_device()])
    assert lease.set_node("node-a", [_gpu("node-a", 0, 10), _gpu("node-a", 1, 20)]) == [
        "node-a/cuda:0", "node-a/cuda:1"]
    assert lease.set_node("node-a", [_gpu("node-a", 0, 9), _gpu("node-a", 1, 20)]) == []  # nothing new
    lease.set_node("node-b", [_gpu("node-b", 0, 5)])
    assert lease.devices == ["cpu", "node-a/cuda:0", "node-a/cuda:1", "node-b/cuda:0"]
    lease.book_worker("tiny", ["node-a/cuda:1"])
    snap = {d["id"]: d for d in lease.snapshot()["devices"]}
    assert snap["node-a/cuda:1"]["node"] == "node-a" and snap["node-a/cuda:1"]["workers"] == ["tiny"]
    # Each node's own GPU 0, with its own memory (not matched by index across nodes).
    assert snap["node-a/cuda:0"]["memory"]["free_mib"] == 9 * 1024
    assert snap["node-b/cuda:0"]["memory"]["free_mib"] == 5 * 1024
    assert snap["cpu"]["node"] is None
    # Jobs run here: this machine's devices come first, and a node's is refused.
    assert lease.preferred()[0] == "cpu"
    with pytest.raises(ValueError, match="node-b/cuda:0 is on a cluster node"):
        asyncio.run(lease.acquire_job("j1", "finetune", ["node-b/cuda:0"], 0))
    with pytest.raises(ValueError, match="given as node"):
        lease.set_node("node-b", [_gpu("node-a", 0, 1)])
    # node-a leaves: its devices and the worker booked there go.
    assert lease.drop_node("node-a") == ["tiny"]
    assert lease.devices == ["cpu", "node-b/cuda:0"]
    assert lease.worker_admission("node-a/cuda:1") == "device node-a/cuda:1 is not managed by this server"
    assert all(d["workers"] == [] for d in lease.snapshot()["devices"])


def _plan(tmp: Path) -> Any:
    path = hdr.llama_gqa(tmp / "big.gguf")
    entry = ModelEntry(id="big", path=str(path), files=[str(path)], size_bytes=8 * GIB, source="dir",
                       root=str(tmp), mtime=0.0, info=read_gguf_info(path))

    def plan(free: int) -> ContextDecision | None:
        return plan_load(entry, ModelSettings(), explicit_ctx=False, target_ctx=4096, min_ctx=1024,
                         free_bytes=free, memory_kind="gpu", slots=4)

    return plan


def test_a_model_goes_on_one_node_with_room_never_across_nodes(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    kw = {"headroom": 0.1, "extra_reserve": GPU_RUNTIME_RESERVE, "plan": plan}
    # The 8 GiB model needs ~10.6 GiB: node-a's two 7 GiB GPUs together, or node-b's one 14 GiB GPU.
    readings = [_gpu("node-a", 0, 7), _gpu("node-a", 1, 7), _gpu("node-b", 0, 14)]
    placed, decision = place_on_nodes(readings, **kw)
    assert placed.node == "node-b" and placed.devices == ["node-b/cuda:0"] and placed.mode == "single"
    assert placed.indices == [0] and decision is not None and not decision.partial_offload
    assert placed.reason.startswith("node node-b: fits on node-b/cuda:0")
    # Of two nodes where it fits whole, the one with the most free memory.
    placed, _ = place_on_nodes([_gpu("node-a", 0, 20), _gpu("node-b", 0, 14)], **kw)
    assert placed.devices == ["node-a/cuda:0"]
    # Only a split fits: on one node's GPUs, never node-a's with node-b's.
    placed, _ = place_on_nodes([_gpu("node-a", 0, 7), _gpu("node-a", 1, 7), _gpu("node-b", 0, 5)], **kw)
    assert placed.mode == "split" and placed.devices == ["node-a/cuda:0", "node-a/cuda:1"]
    assert placed.indices == [0, 1] and placed.node == "node-a"
    # A node without a GPU runs it in its RAM, but only where no GPU can take it whole or split.
    ram_kw = {**kw, "ram_plan": lambda free: _ram_plan(tmp_path, free)}
    placed, _ = place_on_nodes([_gpu("node-a", 0, 14)], ram={"node-c": 64 * GIB}, **ram_kw)
    assert placed.devices == ["node-a/cuda:0"]
    placed, decision = place_on_nodes([_gpu("node-a", 0, 2)], ram={"node-c": 64 * GIB}, **ram_kw)
    assert placed.mode == "cpu" and placed.devices == ["node-c/cpu"] and placed.node == "node-c"
    assert placed.indices == [] and decision is not None and decision.n_ctx == 4096
    assert placed.reason == "node node-c: no GPU there, the model runs in its RAM"
    with pytest.raises(DoesNotFit):
        place_on_nodes([], ram={"node-c": 2 * GIB}, **ram_kw)


def _ram_plan(tmp: Path, free: int) -> ContextDecision | None:
    path = tmp / "big.gguf"
    entry = ModelEntry(id="big", path=str(path), files=[str(path)], size_bytes=8 * GIB, source="dir",
                       root=str(tmp), mtime=0.0, info=read_gguf_info(path))
    return plan_load(entry, ModelSettings(), explicit_ctx=False, target_ctx=4096, min_ctx=1024,
                     free_bytes=free, memory_kind="ram", slots=4)


class _Nodes:
    def __init__(self, readings: list[GpuReading]) -> None:
        self.readings = readings

    def device_ids(self) -> list[str]:
        return [r.device_id for r in self.readings]

    def ram_nodes(self) -> dict[str, int]:
        return {}

    def expect_freed(self, freed: dict[str, int]) -> None:
        raise AssertionError("nothing is stopped in this test")

    async def fresh_readings(self) -> list[GpuReading]:
        return self.readings


async def test_a_load_too_big_for_any_one_node_does_not_fit(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    # 12 GiB in all, but 6 on each machine: the ceiling is one node's memory.
    nodes = _Nodes([_gpu("node-a", 0, 6, total_gib=6), _gpu("node-b", 0, 6, total_gib=6)])
    room = GpuRoom(None, (), lambda _d: None, 0.1, nodes=nodes)
    assert room.enabled() and room.gpu_devices() == ["node-a/cuda:0", "node-b/cuda:0"]
    assert await room.ceiling(0) < 6 * GIB
    # Whole, it fits on neither node (the two are never pooled).
    with pytest.raises(DoesNotFit):
        room.place_now(nodes.readings, lambda free: _strict(plan, free), None)


def _strict(plan: Any, free: int) -> ContextDecision | None:
    """The plan, refusing partial offload (a placement that would put layers in RAM)."""
    decision: ContextDecision | None = plan(free)
    if decision is not None and decision.partial_offload:
        raise DoesNotFit("only with layers in RAM", needed_bytes=decision.needed_bytes, free_bytes=free)
    return decision


def test_a_nodes_name_is_its_label_else_its_host_and_a_taken_name_gets_its_id() -> None:
    node = {"NodeID": "abcdef0123456789", "NodeManagerHostname": "box", "Labels": {"gpuvisor-node": "node-a"}}
    assert _name_for(node, set()) == "node-a"
    assert _name_for({**node, "Labels": {}}, set()) == "box"
    assert _name_for({**node, "Labels": {}}, {"box"}) == "box-abcdef01"


def test_a_nodes_readings_are_its_first_logical_gpus() -> None:
    got = {"gpus": [[1, "u1", "B", 2 * GIB, 24 * GIB], [0, "u0", "A", GIB, 24 * GIB]], "ram": [1, 2]}
    readings = node_readings(ClusterNode("id", "node-a", 1), got)
    assert [(r.device_id, r.name, r.free_bytes) for r in readings] == [("node-a/cuda:0", "A", GIB)]
    assert node_readings(ClusterNode("id", "node-a", 0), got) == []


class _Launcher:
    """The cluster as the watch sees it: alive nodes and their agents' readings."""

    def __init__(self) -> None:
        self.nodes: dict[str, tuple[int, float]] = {}  # name -> (logical GPUs, free GiB)
        self.unanswered: set[str] = set()
        self.reads = 0
        # (reads, name, free GiB): from that many further reads on, the node shows that much free.
        self.later: tuple[int, str, float] | None = None

    async def alive_nodes(self) -> list[ClusterNode]:
        return [ClusterNode(f"id-{n}", n, gpus) for n, (gpus, _) in self.nodes.items()]

    async def read_node(self, node_id: str) -> dict[str, Any]:
        name = node_id.removeprefix("id-")
        self.reads += 1
        if self.later is not None and self.reads >= self.later[0]:
            self.nodes[self.later[1]] = (self.nodes[self.later[1]][0], self.later[2])
            self.later = None
        if name in self.unanswered:
            raise ClusterError("the node agent did not answer within 10s")
        free = int(self.nodes[name][1] * GIB)
        if name.startswith("ram-"):  # no NVIDIA driver there: RAM only
            return {"gpus": [], "ram": [free, 64 * GIB]}
        return {"gpus": [[0, f"u-{name}", "Sim", free, 24 * GIB]], "ram": [1, 2]}


async def test_the_node_watch_adds_a_joining_node_and_drops_a_leaving_one() -> None:
    lease = GpuLease([cpu_device()])
    cluster = _Launcher()
    lost: list[tuple[str, str]] = []
    nodes = ClusterNodes(cluster, lease, lambda n, why: lost.append((n, why)))  # type: ignore[arg-type]
    cluster.nodes = {"head": (0, 0), "node-a": (1, 8), "node-b": (1, 16)}
    await nodes.refresh()
    assert lease.devices == ["cpu", "node-a/cuda:0", "node-b/cuda:0"]  # the head has no GPU to offer
    lease.book_worker("tiny", ["node-b/cuda:0"])
    # An agent that does not answer keeps its node's last reading: slow is not lost.
    cluster.unanswered = {"node-b"}
    assert [r.free_bytes for r in await nodes.fresh_readings()] == [8 * GIB, 16 * GIB]
    assert not lost
    del cluster.nodes["node-b"]
    await nodes.refresh()
    assert lost == [("node-b", "node node-b left the cluster")]
    assert lease.devices == ["cpu", "node-a/cuda:0"] and lease.workers_on()["node-a/cuda:0"] == []
    cluster.nodes["node-c"] = (1, 4)
    await nodes.refresh()
    assert nodes.device_ids() == ["node-a/cuda:0", "node-c/cuda:0"]
    # A node with a logical GPU where nvidia-smi finds none runs models in its RAM.
    cluster.nodes["ram-d"] = (1, 32)
    await nodes.refresh()
    assert nodes.device_ids()[-1] == "ram-d/cpu" and nodes.ram_nodes() == {"ram-d": 32 * GIB}
    snap = {d["id"]: d for d in lease.snapshot()["devices"]}
    assert snap["ram-d/cpu"]["node"] == "ram-d" and snap["ram-d/cpu"]["memory"] == {
        "free_mib": 32 * 1024, "total_mib": 64 * 1024}
    del cluster.nodes["ram-d"]
    await nodes.refresh()
    assert lost[-1] == ("ram-d", "node ram-d left the cluster") and "ram-d/cpu" not in lease.devices


class _Clock:
    """Time that passes only when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds


async def test_a_placement_waits_for_a_stopped_workers_memory_on_its_node() -> None:
    cluster, clock = _Launcher(), _Clock()
    nodes = ClusterNodes(cluster, GpuLease([cpu_device()]), lambda _n, _why: None,  # type: ignore[arg-type]
                         settle_s=10.0, settle_interval_s=0.5, clock=clock, sleep=clock.sleep)
    cluster.nodes = {"node-a": (1, 2), "node-b": (1, 4)}
    await nodes.refresh()
    # A worker planned at 10 GiB stops on node-a: its memory shows free four looks later.
    nodes.expect_freed({"node-a/cuda:0": 10 * GIB})
    cluster.later = (cluster.reads + 8, "node-a", 12)
    readings = {r.device_id: r.free_bytes for r in await nodes.fresh_readings()}
    assert readings["node-a/cuda:0"] == 12 * GIB and readings["node-b/cuda:0"] == 4 * GIB
    assert 0 < clock.now < 10
    # Memory that never comes back: placed with what is free once the bound passed.
    clock.now = 0.0
    nodes.expect_freed({"node-b/cuda:0": 30 * GIB})
    readings = {r.device_id: r.free_bytes for r in await nodes.fresh_readings()}
    assert readings["node-b/cuda:0"] == 4 * GIB and clock.now >= 10
    # Nothing expected: one reading, no wait.
    clock.now = 0.0
    await nodes.fresh_readings()
    assert clock.now == 0.0
    # The pool's eviction tells it through the GPU room: a placement on node-a waits again.
    room = GpuRoom(None, (), lambda _d: None, 0.1, nodes=nodes)
    await room.expect_freed([(GpuPlacement(mode="single", devices=["node-a/cuda:0"], indices=[0], node="node-a"),
                              4 * GIB)])
    await room.readings()
    assert clock.now >= 10  # 12 GiB free never showed the 15 expected


class _RoomConfig:
    n_ctx = 4096
    min_ctx = 1024
    memory_budget_mib = 0
    load_wait_timeout = 0.0
    max_loaded_models = 4


async def _no_drop(_key: tuple[str, bool], _reason: str) -> None:
    raise AssertionError("nothing is loaded to drop")


async def test_a_model_on_a_nodes_own_disk_goes_only_to_a_node_that_holds_it(tmp_path: Path) -> None:
    path = hdr.llama_gqa(tmp_path / "big.gguf")
    held = {"node-a": "/node-a/hub/big.gguf"}
    entry = ModelEntry(id="org/big", path=held["node-a"], files=[held["node-a"]], size_bytes=8 * GIB,
                       source="node", root="", mtime=0.0, info=read_gguf_info(path), nodes=held)
    # node-b has the most room, and the GPU of node-a fits it too: held on node-a only, it goes there.
    nodes = _Nodes([_gpu("node-a", 0, 14), _gpu("node-b", 0, 20)])
    room = Room(_RoomConfig(), {}, {}, _no_drop, asyncio.Event(),
                gpus=GpuRoom(None, (), lambda _d: None, 0.1, nodes=nodes))
    _, placed = await room.fit_placed(entry, ModelSettings(), False, SlotAsk(4, 4), False)
    assert placed.node == "node-a" and placed.devices == ["node-a/cuda:0"]
    # The same file in the shared models dir (no holders named) takes the most room.
    shared = ModelEntry(id="big", path=str(path), files=[str(path)], size_bytes=8 * GIB, source="dir",
                        root=str(tmp_path), mtime=0.0, info=read_gguf_info(path))
    _, placed = await room.fit_placed(shared, ModelSettings(), False, SlotAsk(4, 4), False)
    assert placed.node == "node-b"
    # node-a gone: nowhere to load it, and the refusal says why.
    nodes.readings = [_gpu("node-b", 0, 20)]
    with pytest.raises(Unavailable, match="held only on node-a") as info:
        await room.fit_placed(entry, ModelSettings(), False, SlotAsk(4, 4), False)
    assert info.value.code == "model_not_on_any_node"


async def test_a_model_on_a_nodes_own_disk_is_usable_while_a_node_that_holds_it_serves() -> None:
    listed: list[list[ModelEntry]] = []
    serving: list[str] | None = ["node-b"]

    async def load(_model: str, _embedding: bool) -> None:
        raise AssertionError("no worker ran on the lost node")

    loss = NodeLoss({}, lambda _k: None, lambda: None, load, listed.append, lambda: serving)
    held = ModelEntry(id="org/m", path="/a/m.gguf", files=["/a/m.gguf"], size_bytes=GIB, source="node", root="",
                      mtime=0.0, nodes={"node-a": "/a/m.gguf"})
    loss.set_node_models([held])
    assert not listed[-1][0].usable
    assert listed[-1][0].reason == "it is held only on the own disk of node-a, which is not in the cluster now"
    serving = ["node-a", "node-b"]
    loss.joined("node-a")
    assert listed[-1] == [held]
    serving = ["node-b"]
    loss.lost("node-a", "node node-a left the cluster")
    await loss.stop()
    assert not listed[-1][0].usable
    count = len(listed)
    loss.lost("node-b", "node node-b left the cluster")  # it holds none of them: no new listing
    await loss.stop()
    assert len(listed) == count
    serving = None
    loss.set_node_models([held])
    assert listed[-1][0].reason == "it is held only on the own disk of node-a, and no cluster is configured"


# ---------------------------------------------------------------- AMD GPUs on a node

GPU_FIXTURES = Path(__file__).parent / "fixtures" / "gpu"


def _fake_tool(bindir: Path, name: str, answers: dict[str, str]) -> None:
    """A tool on PATH printing a fixture (tests/fixtures/gpu: the shapes the
    real one prints) chosen by its first argument ("" for any other)."""
    table = {arg: str(GPU_FIXTURES / fixture) for arg, fixture in answers.items()}
    tool = bindir / name
    tool.write_text(f"#!{sys.executable}\nimport sys\ntable = {table!r}\n"
                    "arg = sys.argv[1] if len(sys.argv) > 1 else ''\n"
                    "sys.stdout.write(open(table.get(arg, table[''])).read())\n")
    tool.chmod(0o755)


@pytest.fixture
def node_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The node's PATH, holding only the fake tools (no nvidia-smi), and the
    empty visible-device lists Ray gives an actor that books no GPU."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    monkeypatch.setenv("PATH", str(bindir))
    for name in ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
        monkeypatch.setenv(name, "")
    return bindir


class _AgentCluster:
    """One alive node whose agent runs in this process: the watch gets the agent's own reading."""

    def __init__(self, agent: NodeAgent, gpus: int) -> None:
        self.agent = agent
        self.gpus = gpus

    async def alive_nodes(self) -> list[ClusterNode]:
        return [ClusterNode("id-amd", "node-amd", self.gpus)]

    async def read_node(self, node_id: str) -> dict[str, Any]:
        return await self.agent.read_memory()


async def test_a_node_with_amd_gpus_joins_the_lease_with_them(node_path: Path, tmp_path: Path) -> None:
    _fake_tool(node_path, "amd-smi", {"static": "amd_smi_static_asic.json", "": "amd_smi_metric_mem.json"})
    lease = GpuLease([cpu_device()])
    agent = NodeAgent(str(tmp_path / "agent"))
    nodes = ClusterNodes(_AgentCluster(agent, gpus=2), lease, lambda _n, _why: None)  # type: ignore[arg-type]
    await nodes.refresh()
    assert lease.devices == ["cpu", "node-amd/cuda:0", "node-amd/cuda:1"]
    assert lease.device("node-amd/cuda:1").name == "AMD Instinct MI300X"
    assert lease.node_memory("node-amd/cuda:1") == (114672 * MIB, 196592 * MIB)
    snap = {d["id"]: d for d in lease.snapshot()["devices"]}
    assert snap["node-amd/cuda:0"]["memory"] == {"free_mib": 196309, "total_mib": 196592}
    assert snap["node-amd/cuda:0"]["node"] == "node-amd"
    assert nodes.ram == {}  # GPUs, not the node's RAM


async def test_a_node_agent_reads_rocm_smi_and_without_a_gpu_tool_its_ram(node_path: Path, tmp_path: Path) -> None:
    _fake_tool(node_path, "rocm-smi", {"": "rocm_smi_meminfo.json"})
    got = await NodeAgent(str(tmp_path / "agent")).read_memory()
    assert [(g[0], g[2], g[4]) for g in got["gpus"]] == [
        (0, "Radeon RX 7900 XT", 21458059264), (1, "0x15bf", 4294967296)]
    assert got["gpus"][0][3] == 21458059264 - 27856896
    # No tool and no amdgpu card: no GPU, and the node offers its RAM.
    (node_path / "rocm-smi").unlink()
    bare = NodeAgent(str(tmp_path / "bare"), gpus=node_gpu_source(drm=tmp_path / "no-drm"))
    got = await bare.read_memory()
    assert got["gpus"] == [] and got["ram"][1] > 0
    lease = GpuLease([cpu_device()])
    await ClusterNodes(_AgentCluster(bare, gpus=1), lease, lambda _n, _why: None).refresh()  # type: ignore[arg-type]
    assert lease.devices == ["cpu", "node-amd/cpu"]
