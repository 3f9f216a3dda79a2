"""Jobs on a cluster node, without Ray: the runner given a node's agent.

``AgentNodes`` answers the runner's JobNodes with a real NodeAgent in this
process (the part that runs on a node), so the job process is real and
started by the agent's code; the Ray transport between them is the
real-cluster test's (tests/ray_cluster_inner.py). A node lost is the
agent's end as the node sees it: the job's stdin closes, and the agent no
longer answers.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from jobs.context import EXIT_STOPPED
from jobs.errors import ParamError
from jobs.kinds import decode_params, validate_params
from jobs.params import ResolveContext, Roots, SleepParams
from supervisor.errors import BadRequest
from supervisor.lab.job_command import job_command
from supervisor.lab.job_process import group_alive
from supervisor.lab.job_schema import Job
from supervisor.lab.lease import GpuLease, cpu_device
from supervisor.lab.node_exec import job_node
from supervisor.lab.node_files import NodeFiles
from supervisor.lab.node_jobs import NodeJobLost
from supervisor.lab.runner import JobRunner, RunnerSettings
from supervisor.models.demo import write_tiny_gguf
from supervisor.models.devices import GpuReading
from supervisor.models.entry import ModelEntry
from supervisor.workers.node_agent import NodeAgent
from tests.agent_nodes import AgentNodes
from tests.fake_hub import FakeFile, FakeHub, FakeRepo
from tests.jobsupport import (
    make_roots,
    open_store,
    running_lab,
    wait_finished,
    wait_for,
)
from tests.server import short_tempdir

GIB = 1 << 30


def _reading(node: str, index: int) -> GpuReading:
    return GpuReading(index=index, uuid=f"GPU-{node}-{index}", name="Sim", free_bytes=20 * GIB,
                      total_bytes=24 * GIB, node=node)


@dataclass
class ClusterLab:
    runner: JobRunner
    lease: GpuLease
    nodes: AgentNodes
    agent_dir: Path
    roots: Roots


@asynccontextmanager
async def cluster_lab(base: Path, on_node_models: Callable[[list[ModelEntry]], None] | None = None,
                      **settings: object) -> AsyncIterator[ClusterLab]:
    roots = make_roots(base)
    opts: dict[str, object] = {"heartbeat_timeout_s": 30.0, "keepalive_s": 0.5, "stop_timeout_s": 3.0}
    opts.update(settings)
    cfg = RunnerSettings(state_dir=base / "state", roots=roots, **opts)  # type: ignore[arg-type]
    agent_dir = short_tempdir("gvj")
    nodes = AgentNodes({"node-b": NodeAgent(str(agent_dir))})
    async with open_store(base / "state" / "gpuvisor.db") as store:
        lease = GpuLease([cpu_device()])
        lease.set_node("node-b", [_reading("node-b", 0), _reading("node-b", 1)])
        runner = JobRunner(store, lease, cfg, nodes=nodes, on_node_models=on_node_models)
        await runner.start()
        try:
            yield ClusterLab(runner, lease, nodes, agent_dir, roots)
        finally:
            await runner.stop()


async def test_a_job_booking_a_nodes_gpu_runs_there_and_its_events_come_back(tmp_path: Path) -> None:
    async with cluster_lab(tmp_path) as lab:
        job, _ = await lab.runner.submit("sleep", SleepParams(steps=3, step_seconds=0.01,
                                                              gpu_ids=["node-b/cuda:1"]))
        done = await wait_finished(lab.runner.store, job.id)
        assert done.status == "succeeded", done.error
        assert done.result == {"steps": 3, "events": 3} and done.progress == 1.0 and done.exit_code == 0
        (started,) = lab.nodes.started
        assert started.node == "node-b" and done.pid == started.pid
        types = [e.type for e in await lab.runner.store.events_after(job.id, 0)]
        assert types.count("progress") == 3 and types[-2:] == ["done", "status"]
        assert not group_alive(started.pid)
        assert lab.lease.worker_admission("node-b/cuda:1") is None  # released at its end
        # The agent forgot it (reaped), and its log stays on the node.
        assert not lab.nodes.agents["node-b"]._jobs
        assert (lab.agent_dir / "logs" / f"{job.id}.log").exists()


async def test_a_job_on_a_node_sees_its_gpu_there_and_stops_on_cancel(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_parent_secret")
    async with cluster_lab(tmp_path) as lab:
        job, _ = await lab.runner.submit("sleep", SleepParams(steps=400, step_seconds=0.05,
                                                              gpu_ids=["node-b/cuda:1"]))
        running = await wait_for(lab.runner.store, job.id, lambda j: j.progress > 0)
        (started,) = lab.nodes.started
        env = psutil.Process(started.pid).environ()
        # That node's GPU 1, pinned as a local job's would be; no token for a kind that does not download.
        assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert "HF_TOKEN" not in env
        assert os.getpgid(started.pid) == started.pid  # its own group, signalled whole
        # Held while it runs: inference there is refused; boot recovery has no local process to kill.
        assert lab.lease.worker_admission("node-b/cuda:1") is not None
        assert lab.lease.worker_admission("node-b/cuda:0") is None
        assert running.proc_create_time is None
        await lab.runner.cancel(job.id)
        done = await wait_finished(lab.runner.store, job.id)
        assert done.status == "cancelled" and done.exit_code == EXIT_STOPPED
        assert not group_alive(started.pid)
        assert lab.lease.worker_admission("node-b/cuda:1") is None


async def test_a_node_lost_mid_job_makes_it_interrupted_and_its_process_ends(tmp_path: Path) -> None:
    async with cluster_lab(tmp_path) as lab:
        job, _ = await lab.runner.submit("sleep", SleepParams(steps=400, step_seconds=0.05,
                                                              gpu_ids=["node-b/cuda:0"]))
        await wait_for(lab.runner.store, job.id, lambda j: j.progress > 0)
        (started,) = lab.nodes.started
        lab.nodes.lose(started)
        done = await wait_finished(lab.runner.store, job.id)
        assert done.status == "interrupted", done.error
        assert done.error is not None and "node node-b was lost" in done.error
        # Its stdin closed with the agent: the job process ends on its node.
        proc = lab.nodes.agents["node-b"]._jobs[started.pid].proc
        assert await proc.wait() is not None
        assert lab.lease.worker_admission("node-b/cuda:0") is None


async def test_local_jobs_stay_local_and_a_count_goes_to_one_machine(tmp_path: Path) -> None:
    async with cluster_lab(tmp_path) as lab:
        # One device asked: this machine's (jobs keep running here first).
        job, _ = await lab.runner.submit("sleep", SleepParams(steps=1, step_seconds=0.01))
        done = await wait_finished(lab.runner.store, job.id)
        assert done.status == "succeeded" and lab.nodes.started == []
        assert done.proc_create_time is not None  # a local process: recovery may kill it
        assert done.node is None and done.to_api()["node"] is None  # ran here
        # Two asked: this machine has one, node-b two: the job goes there whole.
        two, _ = await lab.runner.submit("sleep", SleepParams(steps=1, step_seconds=0.01, gpus=2))
        assert two.to_api()["node"] is None  # queued: its params name no node
        done = await wait_finished(lab.runner.store, two.id)
        assert done.status == "succeeded", done.error
        (started,) = lab.nodes.started
        assert started.node == "node-b"
        # Where it ran is recorded, though its params named no node.
        assert done.node == "node-b" and done.to_api()["node"] == "node-b"
        # Three: no machine has them.
        three, _ = await lab.runner.submit("sleep", SleepParams(steps=1, gpus=3))
        done = await wait_finished(lab.runner.store, three.id)
        assert done.status == "failed" and done.error is not None
        assert "no machine has 3 devices" in done.error


async def test_the_lease_books_one_machines_devices_for_a_job() -> None:
    lease = GpuLease([cpu_device()])
    lease.set_node("node-b", [_reading("node-b", 0)])
    with pytest.raises(ValueError, match="jobs run on this machine only"):
        await lease.acquire_job("j1", "sleep", ["node-b/cuda:0"], 0)
    lease.jobs_on_nodes = True
    with pytest.raises(ValueError, match="a job runs on one machine; its devices are on node-b, this machine"):
        await lease.acquire_job("j2", "sleep", ["cpu", "node-b/cuda:0"], 0)
    await lease.acquire_job("j3", "sleep", ["node-b/cuda:0"], 0)
    assert lease.holds("j3") and lease.worker_admission("node-b/cuda:0") is not None
    assert lease.worker_admission("cpu") is None
    lease.release_job("j3")
    assert lease.on_one_machine(["cpu"]) == ["cpu"]
    with pytest.raises(ValueError, match="no machine has 2 devices"):
        lease.on_one_machine(["cpu", "node-b/cuda:0"])
    lease.set_node("node-b", [_reading("node-b", 0), _reading("node-b", 1)])
    assert lease.on_one_machine(["cpu", "node-b/cuda:0"]) == ["node-b/cuda:0", "node-b/cuda:1"]


async def test_a_download_naming_a_node_fills_that_nodes_own_cache_and_is_recorded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real download from a Hub on loopback, run by node-b's agent: the file
    lands in node-b's own Hub cache (its HF_HOME), not the parent's shared
    one; the result names the node; the parent records it in SQLite with the
    header the agent read there, and lists the model with node-b as its holder,
    again after a restart."""
    hub = FakeHub()
    url = await hub.start()
    model = write_tiny_gguf(tmp_path / "tiny.gguf")
    hub.repos["org/Tiny-GGUF"] = FakeRepo({"Tiny-Q8_0.gguf": FakeFile(model.read_bytes()),
                                           "README.md": FakeFile(b"# tiny\n", lfs=False)})
    # node-b's own environment (its agent's): its HF_HOME, and the Hub it reaches.
    node_home, shared = tmp_path / "node-b-hf", tmp_path / "shared-hub"
    monkeypatch.setenv("HF_HOME", str(node_home))
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    listed: list[list[ModelEntry]] = []
    try:
        async with cluster_lab(tmp_path / "lab", listed.append, extra_env={"HF_HUB_CACHE": str(shared)}) as lab:
            assert listed == [[]]  # nothing recorded yet
            params = validate_params("download", {"repo_id": "org/Tiny-GGUF", "node": "node-b"},
                                     ResolveContext(lab.roots))
            job, _ = await lab.runner.submit("download", params)
            done = await wait_finished(lab.runner.store, job.id)
            assert done.status == "succeeded", done.error
            assert done.result is not None and done.result["node"] == "node-b"
            (started,) = lab.nodes.started
            assert started.node == "node-b"
            (file,) = done.result["files"]
            local = Path(file["local_path"])
            assert local.is_relative_to(node_home / "hub") and local.read_bytes() == model.read_bytes()
            assert not shared.exists()  # the parent's cache got nothing
            (held,) = await NodeFiles(lab.runner.store.db).held_models()
            assert (held.model_id, held.node, held.path) == ("org/Tiny-GGUF/Tiny-Q8_0", "node-b", str(local))
            assert held.info is not None and held.info.n_layer > 0 and held.size_bytes == model.stat().st_size
            (entry,) = listed[-1]
            assert entry.id == "org/Tiny-GGUF/Tiny-Q8_0" and entry.nodes == {"node-b": str(local)}
            assert entry.usable and entry.source == "node" and entry.info == held.info
            store = lab.runner.store
            # A restart lists it again from the record.
            again: list[list[ModelEntry]] = []
            runner = JobRunner(store, lab.lease, lab.runner.settings, nodes=lab.nodes, on_node_models=again.append)
            await runner.start()
            await runner.stop()
            assert [e.nodes for e in again[0]] == [{"node-b": str(local)}]
    finally:
        await hub.close()


async def test_a_node_jobs_log_comes_here_while_it_runs_bounded_in_size(tmp_path: Path) -> None:
    async with cluster_lab(tmp_path, node_log_max_bytes=20_000) as lab:
        job, _ = await lab.runner.submit("sleep", SleepParams(steps=400, step_seconds=0.05, use_device=False,
                                                              node="node-b", log_lines=2))
        log_path = lab.runner.settings.logs_dir / f"{job.id}.log"
        # Its lines show here while it still runs, in order, as its node wrote them.
        running = await wait_for(lab.runner.store, job.id,
                                 lambda j: log_path.exists() and "step 3 line 1" in log_path.read_text())
        assert running.status == "running"
        text = log_path.read_text()
        assert text.index("step 1 line 0") < text.index("step 2 line 1") < text.index("step 3 line 1")
        await lab.runner.cancel(job.id)
        assert (await wait_finished(lab.runner.store, job.id)).status == "cancelled"
        # Once ended, all of it is here: what the node's log holds, once.
        on_node = (lab.agent_dir / "logs" / f"{job.id}.log").read_text()
        assert log_path.read_text() == on_node and on_node.count("step 1 line 0") == 1

        # A job that logs more than the bound: the first 20,000 bytes, a line saying where the rest is, its tail.
        chatty, _ = await lab.runner.submit("sleep", SleepParams(steps=60, step_seconds=0.02, use_device=False,
                                                                 node="node-b", log_lines=100))
        done = await wait_finished(lab.runner.store, chatty.id)
        assert done.status == "succeeded", done.error
        here = (lab.runner.settings.logs_dir / f"{chatty.id}.log").read_text()
        on_node = (lab.agent_dir / "logs" / f"{chatty.id}.log").read_text()
        assert len(on_node) > 90_000 and here.startswith(on_node[:20_000])
        assert "the rest of this log stays on node node-b" in here
        assert here.rstrip().endswith("step 60 line 99") and len(here) < 20_000 + 5_000


def _job(job_id: str, kind: str, params: dict[str, object]) -> Job:
    return Job(id=job_id, kind=kind, status="running", priority=0, params=params, progress=0.0, stage=None,
               message=None, result=None, error=None, attempt=1, created_at=0.0, started_at=None,
               finished_at=None, heartbeat_at=None, pid=None, pgid=None, proc_create_time=None, exit_code=None,
               cancel_requested_at=None, log_path=None, unique_key=job_id, last_seq=0)


def test_a_jobs_command_is_built_once_for_here_and_for_a_node(tmp_path: Path) -> None:
    parent = {"HF_TOKEN": "hf_x", "PATH": "/p", "GPUVISOR_ADMIN_TOKEN": "adm"}
    settings = RunnerSettings(state_dir=tmp_path, roots=make_roots(tmp_path),
                              extra_env={"HF_HUB_CACHE": "/shared/hub"})
    job = _job("j1", "finetune", {"model": "m"})
    # Pinned GPUs and the extra settings; the machine's own allowlist supplies PATH and the rest.
    cmd = job_command(job, settings, [1, 2], environ=parent)
    assert cmd.argv == ["-m", "jobs", "finetune"]
    assert cmd.env["CUDA_VISIBLE_DEVICES"] == "1,2" and cmd.env["HIP_VISIBLE_DEVICES"] == "0,1"
    assert cmd.env["HF_HUB_CACHE"] == "/shared/hub"
    assert "HF_TOKEN" not in cmd.env and "PATH" not in cmd.env and "GPUVISOR_ADMIN_TOKEN" not in cmd.env
    line = json.loads(cmd.stdin_line)
    assert cmd.stdin_line.endswith(b"\n") and line["params"] == {"model": "m"}
    assert line["context"]["job_id"] == "j1" and line["context"]["models_dir"] == str(settings.roots.models)
    download = _job("j2", "download", {})
    # No GPU booked: none seen; the token for the kind that downloads.
    env = job_command(download, settings, [], environ=parent).env
    assert env["HF_TOKEN"] == "hf_x" and env["CUDA_VISIBLE_DEVICES"] == ""
    # On a machine without GPUs the device variables are left alone.
    assert "CUDA_VISIBLE_DEVICES" not in job_command(download, settings, None, environ=parent).env
    assert job_node(["node-b/cuda:0", "node-b/cuda:1"]) == "node-b" and job_node(["cpu"]) == ""
    with pytest.raises(ValueError, match="one machine"):
        job_node(["node-a/cuda:0", "node-b/cuda:0"])


async def test_a_quantize_naming_a_node_runs_there_and_its_events_come_back(tmp_path: Path) -> None:
    async with cluster_lab(tmp_path) as lab:
        write_tiny_gguf(lab.roots.models / "tiny.gguf")
        params = validate_params("quantize", {"model": "tiny", "type": "Q8_0", "node": "node-b"},
                                 ResolveContext(lab.roots))
        job, _ = await lab.runner.submit("quantize", params)
        done = await wait_finished(lab.runner.store, job.id)
        assert done.status == "succeeded", done.error
        (started,) = lab.nodes.started
        assert started.node == "node-b" and done.pid == started.pid
        assert done.proc_create_time is None  # another machine's pid: boot recovery never kills it
        assert done.result is not None and Path(done.result["output_path"]).is_file()
        assert Path(done.result["output_path"]).parent == lab.roots.models
        types = [e.type for e in await lab.runner.store.events_after(job.id, 0)]
        assert types[0] == "started" and types[-2:] == ["done", "status"]
        assert (lab.agent_dir / "logs" / f"{job.id}.log").exists()


async def test_a_job_naming_a_node_sees_no_gpu_there_stops_on_cancel_and_is_interrupted_with_it(
        tmp_path: Path) -> None:
    async with cluster_lab(tmp_path) as lab:
        job, _ = await lab.runner.submit("sleep", SleepParams(steps=400, step_seconds=0.05, use_device=False,
                                                              node="node-b"))
        await wait_for(lab.runner.store, job.id, lambda j: j.progress > 0)
        (started,) = lab.nodes.started
        assert started.node == "node-b"
        # It books no GPU of node-b, so it sees none of them; both stay free for workers.
        assert psutil.Process(started.pid).environ()["CUDA_VISIBLE_DEVICES"] == ""
        assert lab.lease.worker_admission("node-b/cuda:0") is None
        await lab.runner.cancel(job.id)
        done = await wait_finished(lab.runner.store, job.id)
        assert done.status == "cancelled" and done.exit_code == EXIT_STOPPED
        assert not group_alive(started.pid)

        lost, _ = await lab.runner.submit("sleep", SleepParams(steps=400, step_seconds=0.05, use_device=False,
                                                               node="node-b", tag="lost"))
        await wait_for(lab.runner.store, lost.id, lambda j: j.progress > 0)
        second = lab.nodes.started[-1]
        lab.nodes.lose(second)
        done = await wait_finished(lab.runner.store, lost.id)
        assert done.status == "interrupted" and done.error is not None
        assert "node node-b was lost while the job ran" in done.error
        assert await lab.nodes.agents["node-b"]._jobs[second.pid].proc.wait() is not None

        # Devices on one machine and a node named for another: failed with both named.
        both, _ = await lab.runner.submit("sleep", SleepParams(steps=1, gpu_ids=["cpu"], node="node-b"))
        done = await wait_finished(lab.runner.store, both.id)
        assert done.status == "failed" and done.error is not None
        assert "names node node-b, and its devices are on this machine" in done.error


async def test_a_node_that_is_not_alive_or_no_cluster_is_a_400_naming_it(tmp_path: Path) -> None:
    async with cluster_lab(tmp_path / "cluster") as lab:
        with pytest.raises(BadRequest, match=r"node 'node-z' is not an alive node of the cluster \(alive: node-b\)") as info:
            await lab.runner.submit("sleep", SleepParams(use_device=False, node="node-z"))
        assert info.value.param == "params.node" and info.value.status == 400
        assert (await lab.runner.store.list_jobs()).jobs == [] and lab.nodes.started == []
    async with running_lab(tmp_path / "alone") as alone:
        (alone.roots.datasets / "raw.jsonl").write_text("{}\n")
        params = validate_params("dataset", {"input": "raw.jsonl", "node": "node-b"}, ResolveContext(alone.roots))
        with pytest.raises(BadRequest, match="node 'node-b': no cluster is configured") as info:
            await alone.runner.submit("dataset", params)
        assert info.value.param == "params.node"
    # A name no node can have is refused where the params are decoded, naming the field.
    with pytest.raises(ParamError) as bad:
        decode_params("download", {"repo_id": "o/r", "node": "node-b/cuda:0"})
    assert bad.value.param == "params.node"


async def test_a_silent_job_on_a_node_is_killed_and_a_shutdown_interrupts_one(tmp_path: Path) -> None:
    async with cluster_lab(tmp_path, heartbeat_timeout_s=1.0) as lab:
        # It stops itself (SIGSTOP) at step 1: no events, so it is killed there by its group.
        job, _ = await lab.runner.submit("sleep", SleepParams(steps=5, crash="stop", crash_at_step=1,
                                                              gpu_ids=["node-b/cuda:0"]))
        done = await wait_finished(lab.runner.store, job.id)
        assert done.status == "failed" and done.error is not None and "no events" in done.error
        assert done.exit_code == -signal.SIGKILL
        (silent,) = lab.nodes.started
        assert not group_alive(silent.pid)

        job, _ = await lab.runner.submit("sleep", SleepParams(steps=400, step_seconds=0.05,
                                                              gpu_ids=["node-b/cuda:0"]))
        await wait_for(lab.runner.store, job.id, lambda j: j.progress > 0)
        await lab.runner.stop()
        done = await lab.runner.store.get(job.id)
        assert done.status == "interrupted" and done.error == "supervisor shut down"
        assert not group_alive(lab.nodes.started[-1].pid)


class _Calls:
    """One method of a fake agent actor: ``.remote()`` answers the next outcome in turn."""

    def __init__(self, outcomes: list[object]) -> None:
        self.outcomes = outcomes
        self.sent = 0

    def remote(self, *_: object) -> object:
        self.sent += 1
        outcome = self.outcomes.pop(0) if self.outcomes else (b"", None)

        async def answer() -> object:
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome

        return answer()


async def test_an_unreachable_agent_is_waited_for_and_a_dead_one_loses_the_job(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """How RayNodeJob reads Ray's errors (Ray's own exception classes; the
    transport itself is the real-cluster test's): unreachable for a while is
    not lost, dead is, and the agent's own failure is no node's loss."""
    ray = pytest.importorskip("ray")
    from ray import exceptions as rex

    from supervisor.workers import ray_launcher as rl

    def job(outcomes: list[object]) -> tuple[rl.RayNodeJob, _Calls, _Calls, list[str]]:
        reads, signals = _Calls(outcomes), _Calls([])
        actor = type("Actor", (), {"read_job": reads, "signal_job": signals})()
        lost: list[str] = []
        return (rl.RayNodeJob(rl._Agent("id-b", actor, Path("."), 1), "node-b", 42, ray,
                              lambda: lost.append("forgotten")), reads, signals, lost)

    blip = rex.ActorUnavailableError("connection reset", None)
    waited, _, _, lost = job([blip, (b'{"type":"log"}\n', None), (b"", 0)])
    assert await waited.read(0.01) == (b"", None)  # unreachable once: asked again
    assert await waited.read(0.01) == (b'{"type":"log"}\n', None)
    assert await waited.read(0.01) == (b"", 0) and lost == []

    dead, _, signals, lost = job([rex.ActorDiedError()])
    with pytest.raises(NodeJobLost, match="node node-b was lost while the job ran"):
        await dead.read(0.01)
    assert lost == ["forgotten"]
    dead.signal(signal.SIGTERM)
    assert signals.sent == 0  # nothing is sent to a gone agent

    monkeypatch.setattr(rl, "AGENT_CALL_TIMEOUT", 0.05)
    gone, _, _, lost = job([blip] * 100)
    with pytest.raises(NodeJobLost, match="unavailable"):
        for _ in range(100):
            await gone.read(0.01)
    assert lost == ["forgotten"]

    own_failure = rex.RayTaskError("read_job", "tb", ValueError("no job with pid 42"))  # type: ignore[no-untyped-call]
    failed, _, _, lost = job([own_failure])
    with pytest.raises(rl.ClusterError) as info:
        await failed.read(0.01)
    assert not isinstance(info.value, NodeJobLost) and lost == []
