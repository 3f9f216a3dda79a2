"""Workers on a real Ray cluster, run by tests/test_ray_cluster.py inside a
private network (and process) namespace: a head with no GPUs and three
nodes (``node-a``, ``node-b``, ``node-c``) with one logical GPU each, all on
loopback. Two have a fake nvidia-smi on their PATH: node-a's GPU shows 8 GiB
free, node-b's 16 GiB; node-c has none, so it offers its RAM. Not collected
on its own (its name is no test_*.py); run outside that namespace it skips.

- A handle's worker is started by the node agent of the node its device
  names, serves a stream, and a forged Hello sent to the spawn's TCP
  listener first is refused.
- A whole server on the cluster lists the nodes' GPUs (and node-c's RAM) in
  /api/gpu, places the model on node-b (the room), streams a chat through
  it; SIGKILLed, it leaves neither that worker nor its agent running.
- node-b's raylet killed mid-stream: its agent goes, and with it the worker;
  the stream ends with the error node_lost and [DONE], node-b's GPU leaves the lease,
  and the model comes back on node-a (a GPU before node-c's RAM), where a
  chat works.
- A server stopped by SIGTERM exits cleanly and its workers on the nodes
  end. Before that, a download job naming node-a fetches a model from a
  fake Hub on loopback into node-a's own Hub cache; the library lists it
  held on node-a, and its worker goes to node-a although node-b has more
  room; a node that is not in the cluster is a 400.
- A job booking node-b's GPU runs there, started by node-b's agent with
  that GPU pinned, while a chat is served on node-a; its events reach
  /api/jobs/{id}/events and its log to /api/jobs/{id}/log while it runs,
  and a cancel stops it there; a second job there is
  interrupted when node-b's raylet dies, and its process ends; a third,
  with node-b back, ends with its agent when the parent is SIGKILLed.
- A finetune of a tiny HF model on node-b, cancelled with save, writes a
  checkpoint into the shared outputs dir and stops there.
- A measurement (issue 28's benchmark): a 1,000-token stream through a
  worker on node-b against one through a worker on this machine, run by
  run in turn; it prints both rates and their ratio.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import re
import signal
import statistics
import time
from pathlib import Path

import httpx
import psutil
import pytest

from supervisor.workers.connection import Endpoint
from supervisor.workers.handle import WorkerHandle, WorkerState
from supervisor.workers.queue import WorkerGone
from supervisor.workers.spec import WorkerSpec
from tests.ray_cluster_support import (  # noqa: F401  (cluster: the module's fixture)
    ORPHAN_BOUND_S,
    TIMING,
    Cluster,
    ForgingRayLauncher,
    _agent_of,
    _cluster_server,
    _download_to_node_a,
    _gpu,
    _job,
    _raylet_of,
    _running,
    _stream_rate,
    cluster,
)
from tests.server import Server, poll_until, running, short_tempdir
from worker import protocol as p

pytestmark = [
    pytest.mark.skipif(os.environ.get("GPUVISOR_RAY_NETNS") != "1",
                       reason="runs only inside the private namespace tests/test_ray_cluster.py makes"),
    # Coarse, against hangs: the two nodes start in ~20 s, but on a loaded machine in minutes.
    pytest.mark.timeout(200),
]


async def test_a_node_agent_starts_a_worker_that_serves_and_a_forged_hello_is_refused(
        cluster: Cluster, tiny_model_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "gpuvisor.worker")
    run, logs = short_tempdir(), short_tempdir()
    launcher = ForgingRayLauncher(cluster.address, logs)
    spec = WorkerSpec("tiny", tiny_model_path, False, 256, 0, 1, devices=("node-a/cuda:0",), gpu_indices=(0,))
    handle = WorkerHandle(spec, TIMING, run, logs, 8, launcher=launcher, endpoint=Endpoint.parse("tcp:127.0.0.1"))
    handle.start()
    try:
        await asyncio.wait_for(handle.ready.wait(), 90)
        assert launcher.answer == b""
        assert any("proves no secret" in r.getMessage() for r in caplog.records), caplog.text
        assert f"started on node {cluster.nodes['node-a'][:12]} (node-a;" in caplog.text
        assert handle.pid is not None
        agent = _agent_of(handle.pid)
        assert psutil.Process(handle.pid).environ()["CUDA_VISIBLE_DEVICES"] == "0"
        pend = handle.submit(p.Generate(0, p.SamplingParams(max_tokens=4, temperature=0.0), prompt="once"))
        while True:
            event = await asyncio.wait_for(pend.events.get(), 60)
            assert not isinstance(event, WorkerGone | p.Error), event
            if isinstance(event, p.Done):
                break
        assert event.completion_tokens == 4
        pid = handle.pid
    finally:
        await handle.stop()
    assert handle.state is WorkerState.STOPPED
    assert launcher.started is not None and launcher.started.returncode is not None
    assert not _running(pid)
    assert agent.is_running()  # the agent stays for the next worker on its node
    # ...and has forgotten the reaped worker (its cleanup ran).
    # The cleanup is sent without waiting for it: the agent may answer one more call first.
    (node_agent,) = launcher._agents.values()
    deadline = time.monotonic() + 30
    while True:
        try:
            await asyncio.wait_for(node_agent.actor.wait.remote(pid), 30)
        except Exception as exc:  # noqa: BLE001 - Ray wraps the agent's UnknownWorker in a class of its own
            assert f"no worker with pid {pid}" in str(exc), exc
            break
        assert time.monotonic() < deadline, "the agent never forgot the reaped worker"
        await asyncio.sleep(0.2)


def test_a_chat_streams_through_a_node_and_a_killed_parent_leaves_no_worker(
        cluster: Cluster, tiny_model_path: Path) -> None:
    srv = _cluster_server(cluster, tiny_model_path)
    with running(srv):
        # The nodes' GPUs join the lease, named by node, with their memory; node-c, with no GPU, its RAM.
        gpus = poll_until(lambda: _gpu(srv), lambda g: {"node-a/cuda:0", "node-b/cuda:0", "node-c/cpu"} <= set(g),
                          timeout=60)
        assert gpus["node-b/cuda:0"]["node"] == "node-b" and gpus["node-b/cuda:0"]["memory"]["free_mib"] == 16384
        assert gpus["node-a/cuda:0"]["memory"]["free_mib"] == 8192
        ram = psutil.virtual_memory().total >> 20
        assert gpus["node-c/cpu"]["node"] == "node-c" and gpus["node-c/cpu"]["memory"]["total_mib"] == ram
        assert gpus["cpu"]["node"] is None  # this machine's own device, for jobs
        body = {"model": "tiny", "stream": True, "max_tokens": 6, "temperature": 0,
                "messages": [{"role": "user", "content": "hello"}]}
        lines = []
        with httpx.stream("POST", srv.base_url + "/v1/chat/completions", json=body, timeout=120) as resp:
            assert resp.status_code == 200, resp.read()
            lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        assert any(c["choices"] and c["choices"][0]["delta"].get("content") for c in chunks), chunks
        worker = srv.worker()
        pid = int(worker["pid"])
        # Placed on the node with the most room, pinned to its GPU there.
        assert worker["devices"] == ["node-b/cuda:0"] and worker["placement"]["node"] == "node-b", worker
        assert re.search(rf"worker tiny started on node {cluster.nodes['node-b'][:12]} \(node-b; pid {pid},",
                         srv.log_text())
        gpus = _gpu(srv)
        assert gpus["node-b/cuda:0"]["workers"] == ["tiny"] and gpus["node-a/cuda:0"]["workers"] == []
        assert psutil.Process(pid).environ()["CUDA_VISIBLE_DEVICES"] == "0"  # node-b's GPU 0, pinned there
        agent = _agent_of(pid)
        placed = re.search(r"tiny placed on node-b/cuda:0 in ([0-9.]+)s", srv.log_text())
        assert placed is not None, srv.log_text()[-3000:]
        print(f"measured: placement on the cluster's nodes took {placed.group(1)}s")
        assert srv.proc is not None
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait(10)
        killed = time.monotonic()
        poll_until(lambda: (_running(pid), _running(agent.pid)), lambda alive: alive == (False, False),
                   timeout=ORPHAN_BOUND_S, interval=0.2)
        print(f"measured: worker and agent gone {time.monotonic() - killed:.1f}s after the parent's SIGKILL")


def test_a_stopped_parent_stops_its_workers_on_the_nodes(cluster: Cluster, tiny_model_path: Path) -> None:
    srv = _cluster_server(cluster, tiny_model_path)
    with running(srv):
        r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=120, json={
            "model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
        pid = int(srv.worker()["pid"])
        assert _running(pid)
        assert srv.worker()["devices"] == ["node-b/cuda:0"]  # the most room
        held = int(srv.worker(_download_to_node_a(srv, cluster, tiny_model_path))["pid"])
        # The service's own stop (systemctl stop): the worker is shut down, the driver leaves.
        assert srv.stop(signal.SIGTERM, timeout=60) == 0, srv.log_text()[-3000:]
        poll_until(lambda: (_running(pid), _running(held)), lambda alive: alive == (False, False),
                   timeout=ORPHAN_BOUND_S, interval=0.2)


def test_a_model_on_node_as_own_disk_is_removed_there_and_a_lost_file_is_named(
        cluster: Cluster, tiny_model_path: Path) -> None:
    """DELETE of a model held on node-a's own disk: its worker there is
    unloaded and node-a's agent removes its files from node-a's Hub cache.
    Downloaded again and then lost from node-a's disk by hand, a load is
    refused naming node-a and the file, and the model is listed unusable
    with the reason until it is deleted."""
    srv = _cluster_server(cluster, tiny_model_path)
    with running(srv):
        model = _download_to_node_a(srv, cluster, tiny_model_path)
        pid = int(srv.worker(model)["pid"])
        repo = cluster.hf_homes["node-a"] / "hub" / "models--org--Tiny-GGUF"
        assert repo.is_dir()
        r = httpx.delete(f"{srv.base_url}/api/models/{model}", timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["nodes"] == ["node-a"] and r.json()["freed_bytes"] == tiny_model_path.stat().st_size
        assert not repo.exists()
        poll_until(lambda: _running(pid), lambda alive: not alive, timeout=30, interval=0.2)
        assert httpx.get(f"{srv.base_url}/api/models/{model}", timeout=30).status_code == 404

        model = _download_to_node_a(srv, cluster, tiny_model_path)
        assert httpx.post(f"{srv.base_url}/api/models/{model}/unload", timeout=60).status_code == 200
        (local,) = [p for p in (repo / "snapshots").rglob("*.gguf")]
        local.unlink()  # gone from node-a's disk behind the service's back
        r = httpx.post(f"{srv.base_url}/api/models/{model}/load", timeout=60)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_file_missing", r.text
        assert r.json()["error"]["message"] == (f"model {model}'s file {local} is no longer on node node-a; "
                                                "its record there was dropped")
        # Listed as unusable, saying why, until it is deleted (or downloaded again).
        lost = httpx.get(f"{srv.base_url}/api/models/{model}", timeout=30).json()
        assert lost["state"] == "unusable" and lost["reason"] == (
            f"its file {local} is gone from node node-a, the last node that held it; download it again"), lost
        r = httpx.post(f"{srv.base_url}/api/models/{model}/load", timeout=60)
        assert r.status_code == 503 and "gone from node node-a" in r.json()["error"]["message"], r.text
        assert httpx.delete(f"{srv.base_url}/api/models/{model}", timeout=60).json()["nodes"] == []
        assert httpx.get(f"{srv.base_url}/api/models/{model}", timeout=30).status_code == 404


def test_a_stream_through_a_node_against_a_local_worker(cluster: Cluster, tiny_model_path: Path) -> None:
    remote = _cluster_server(cluster, tiny_model_path)
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    local = Server(models, env={"GPUVISOR_N_CTX": "2048"})
    with running(remote), running(local):
        servers = {"node": remote, "local": local}
        for srv in servers.values():
            _stream_rate(srv, 8)  # loads the model
        assert remote.worker()["devices"] == ["node-b/cuda:0"] and local.worker()["devices"] == ["cpu"]
        rates: dict[str, list[float]] = {name: [] for name in servers}
        for _ in range(3):  # in turn, so that the machine's drift hits both alike
            for name, srv in servers.items():
                rates[name].append(_stream_rate(srv, 1000))
        node, here = (statistics.median(rates[name]) for name in servers)
        print(f"measured: a 1,000-token stream through a worker on node-b at {node:.0f} tok/s, "
              f"through a worker on this machine at {here:.0f} tok/s: ratio {node / here:.2f} "
              f"(runs: {', '.join(f'{r:.0f}' for r in rates['node'])} / {', '.join(f'{r:.0f}' for r in rates['local'])})")


def test_a_job_on_node_b_runs_there_while_node_a_serves_and_a_cancel_stops_it(
        cluster: Cluster, tiny_model_path: Path) -> None:
    srv = _cluster_server(cluster, tiny_model_path)
    with running(srv):
        poll_until(lambda: _gpu(srv), lambda g: {"node-a/cuda:0", "node-b/cuda:0"} <= set(g), timeout=60)
        r = httpx.post(srv.base_url + "/api/jobs", timeout=30, json={
            "kind": "sleep", "params": {"steps": 4000, "step_seconds": 0.05, "gpu_ids": ["node-b/cuda:0"],
                                        "log_lines": 1}})
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        running_job = poll_until(lambda: _job(srv, job_id), lambda j: j["status"] == "running" and j["progress"] > 0,
                                 timeout=90, interval=0.2)
        # Its log (stderr on node-b) shows here while it runs.
        poll_until(lambda: httpx.get(f"{srv.base_url}/api/jobs/{job_id}/log", timeout=30).text,
                   lambda text: "step 2 line 0" in text, timeout=30, interval=0.3)
        assert _job(srv, job_id)["status"] == "running"
        pid = int(running_job["pid"])
        # Started by node-b's agent, with node-b's GPU 0 pinned, its own group.
        agent = _agent_of(pid)
        assert f"job process {job_id}.log started on node node-b (pid {pid}, agent pid {agent.pid})" in srv.log_text()
        assert psutil.Process(pid).environ()["CUDA_VISIBLE_DEVICES"] == "0" and os.getpgid(pid) == pid
        assert _gpu(srv)["node-b/cuda:0"]["holder"]["job_id"] == job_id
        # The model goes where no job holds the GPU, and serves while the job runs.
        r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=120, json={
            "model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
        assert srv.worker()["devices"] == ["node-a/cuda:0"]
        assert _job(srv, job_id)["status"] == "running"
        r = httpx.post(f"{srv.base_url}/api/jobs/{job_id}/cancel", timeout=30)
        assert r.status_code == 200, r.text
        done = poll_until(lambda: _job(srv, job_id), lambda j: j["status"] != "running", timeout=60, interval=0.2)
        assert done["status"] == "cancelled", done
        poll_until(lambda: _running(pid), lambda alive: not alive, timeout=ORPHAN_BOUND_S, interval=0.2)
        # Its events came back to this server's store: replayed from the start, the end last.
        kinds: list[str] = []
        with httpx.stream("GET", f"{srv.base_url}/api/jobs/{job_id}/events", timeout=60) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("event: "):
                    kinds.append(line[7:])
        assert kinds[0] == "started" and kinds[-1] == "end", kinds
        assert kinds.count("progress") >= 1
        assert _gpu(srv)["node-b/cuda:0"]["holder"] is None
        r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=120, json={
            "model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "again"}]})
        assert r.status_code == 200, r.text
        # A second job there, and node-b's raylet killed under it: the job is interrupted, with the reason,
        # and its process ends with its agent (its stdin closes).
        r = httpx.post(srv.base_url + "/api/jobs", timeout=30, json={
            "kind": "sleep", "params": {"steps": 4000, "step_seconds": 0.05, "gpu_ids": ["node-b/cuda:0"]}})
        assert r.status_code == 201, r.text
        lost_id = r.json()["id"]
        running_job = poll_until(lambda: _job(srv, lost_id), lambda j: j["progress"] > 0, timeout=90, interval=0.2)
        pid = int(running_job["pid"])
        _raylet_of(cluster.nodes["node-b"]).kill()
        killed = time.monotonic()
        done = poll_until(lambda: _job(srv, lost_id), lambda j: j["status"] != "running", timeout=60, interval=0.2)
        took = time.monotonic() - killed
        assert done["status"] == "interrupted", done
        assert "node node-b was lost while the job ran" in done["error"], done
        poll_until(lambda: _running(pid), lambda alive: not alive, timeout=ORPHAN_BOUND_S, interval=0.2)
        print(f"measured: a job on node-b was interrupted {took:.1f}s after its raylet died")
        # node-b back (for the tests after this one too, with its new node id).
        cluster.start_node("node-b")
        import ray

        cluster.nodes["node-b"] = next(n["NodeID"] for n in ray.nodes()  # type: ignore[no-untyped-call]
                                       if n["Alive"] and n["Labels"].get("gpuvisor-node") == "node-b")
        poll_until(lambda: _gpu(srv), lambda g: "node-b/cuda:0" in g, timeout=90)
        # A job there when the parent is SIGKILLed: its agent goes with the parent, and the job with its stdin.
        r = httpx.post(srv.base_url + "/api/jobs", timeout=30, json={
            "kind": "sleep", "params": {"steps": 4000, "step_seconds": 0.05, "gpu_ids": ["node-b/cuda:0"]}})
        assert r.status_code == 201, r.text
        orphan_id = r.json()["id"]
        pid = int(poll_until(lambda: _job(srv, orphan_id), lambda j: j["progress"] > 0, timeout=90,
                             interval=0.2)["pid"])
        agent = _agent_of(pid)
        assert srv.proc is not None
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait(10)
        poll_until(lambda: (_running(pid), _running(agent.pid)), lambda alive: alive == (False, False),
                   timeout=ORPHAN_BOUND_S, interval=0.2)


def test_a_finetune_on_node_b_saves_a_checkpoint_there_when_cancelled_with_save(cluster: Cluster) -> None:
    pytest.importorskip("peft", reason="needs the train extra")
    from tests.tiny_hf import build_tiny_model, write_chat_dataset

    # The nodes share this machine's disk: the paths are the parent's, as on a shared dir.
    models, data, outputs = short_tempdir("gvm"), short_tempdir("gvd"), short_tempdir("gvo")
    build_tiny_model(models / "tiny-hf")
    write_chat_dataset(data / "qa.train.jsonl", repeats=8)
    srv = Server(models, env={"GPUVISOR_RAY_ADDRESS": cluster.address, "GPUVISOR_WORKER_LISTEN": "tcp:127.0.0.1",
                              "GPUVISOR_DATASETS_DIR": str(data), "GPUVISOR_OUTPUTS_DIR": str(outputs)})
    with running(srv):
        poll_until(lambda: _gpu(srv), lambda g: "node-b/cuda:0" in g, timeout=60)
        r = httpx.post(srv.base_url + "/api/jobs", timeout=30, json={"kind": "finetune", "params": {
            "model": "tiny-hf", "train": "qa.train.jsonl", "max_steps": 400, "learning_rate": 5e-3,
            "batch_size": 4, "gradient_accumulation_steps": 1, "save_steps": 1000,
            "gpu_ids": ["node-b/cuda:0"]}})
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        running_job = poll_until(lambda: _job(srv, job_id),
                                 lambda j: j["progress"] >= 2 / 400 or j["status"] not in ("queued", "running"),
                                 timeout=150, interval=0.3)
        assert running_job["status"] == "running", running_job
        pid = int(running_job["pid"])
        assert f"job process {job_id}.log started on node node-b" in srv.log_text()
        r = httpx.post(f"{srv.base_url}/api/jobs/{job_id}/cancel", json={"save": True}, timeout=30)
        assert r.status_code == 200, r.text
        done = poll_until(lambda: _job(srv, job_id), lambda j: j["status"] not in ("queued", "running"),
                          timeout=120, interval=0.3)
        assert done["status"] == "cancelled", done
        poll_until(lambda: _running(pid), lambda alive: not alive, timeout=ORPHAN_BOUND_S, interval=0.2)
        saved = []
        with httpx.stream("GET", f"{srv.base_url}/api/jobs/{job_id}/events", timeout=60) as resp:
            event = ""
            for line in resp.iter_lines():
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: ") and event == "metric" and '"checkpoint"' in line:
                    data_ = json.loads(line[6:])["data"]
                    saved.append((int(data_["step"]), Path(data_["checkpoint"])))
        # SIGUSR1 reached it through node-b's agent: it wrote a checkpoint into the shared outputs dir.
        assert saved and saved[-1][0] >= 2, saved
        assert saved[-1][1].resolve().is_relative_to(outputs.resolve()) and saved[-1][1].exists(), saved


def test_a_node_lost_mid_stream_ends_the_stream_and_the_model_comes_back_on_another_node(
        cluster: Cluster, tiny_model_path: Path) -> None:
    srv = _cluster_server(cluster, tiny_model_path)
    with running(srv):
        poll_until(lambda: _gpu(srv), lambda g: {"node-a/cuda:0", "node-b/cuda:0"} <= set(g), timeout=60)
        body = {"model": "tiny", "stream": True, "max_tokens": 1900, "ignore_eos": True, "temperature": 0,
                "messages": [{"role": "user", "content": "go"}]}
        lines: list[str] = []
        pid = agent_pid = 0
        lost = 0.0
        with httpx.stream("POST", srv.base_url + "/v1/chat/completions", json=body, timeout=120) as resp:
            assert resp.status_code == 200, resp.read()
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                lines.append(line)
                if len(lines) == 3:
                    worker = srv.worker()
                    assert worker["devices"] == ["node-b/cuda:0"], worker
                    pid = int(worker["pid"])
                    agent_pid = _agent_of(pid).pid
                    # Held still, so that the stream cannot finish before its node is gone.
                    os.kill(pid, signal.SIGSTOP)
                    _raylet_of(cluster.nodes["node-b"]).kill()
                    lost = time.monotonic()
                    # The raylet's workers end with it: the agent, which holds the worker's stdin.
                    poll_until(functools.partial(_running, agent_pid), lambda alive: not alive,
                               timeout=ORPHAN_BOUND_S)
                    try:
                        os.kill(pid, signal.SIGCONT)
                    except ProcessLookupError:
                        pass  # already ended: the parent found it silent past the ping timeout and killed it
        ended = time.monotonic() - lost
        # The stream ended cleanly: an error event, then [DONE].
        assert lines[-1] == "data: [DONE]", lines[-3:]
        error = json.loads(lines[-2][6:])["error"]
        # Its connection broke as the node went, and it ended once the cluster declared the node gone.
        assert error["code"] == "node_lost", error
        assert "node node-b left the cluster" in error["message"], error
        poll_until(lambda: _running(pid), lambda alive: not alive, timeout=ORPHAN_BOUND_S)
        # The cluster declares node-b dead: its GPU leaves the lease, and the model is placed on node-a.
        gpus = poll_until(lambda: _gpu(srv), lambda g: "node-b/cuda:0" not in g
                          and g["node-a/cuda:0"]["workers"] == ["tiny"], timeout=90)
        back = srv.wait_worker(lambda w: w["state"] == "ready", timeout=90)
        assert back["devices"] == ["node-a/cuda:0"], back
        print(f"measured: after node-b's raylet died, the stream ended in {ended:.1f}s and the model "
              f"served again on node-a in {time.monotonic() - lost:.1f}s")
        assert "node node-b left the cluster" in srv.log_text()
        r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=120, json={
            "model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "again"}]})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
        assert gpus["node-a/cuda:0"]["node"] == "node-a"
        # node-b starts again (a new Ray node, the same name): its GPU joins the lease again, free.
        cluster.start_node("node-b")
        gpus = poll_until(lambda: _gpu(srv), lambda g: "node-b/cuda:0" in g, timeout=90)
        assert gpus["node-b/cuda:0"]["workers"] == [] and gpus["node-b/cuda:0"]["memory"]["free_mib"] == 16384
        assert gpus["node-a/cuda:0"]["workers"] == ["tiny"]  # a model that runs stays where it is
