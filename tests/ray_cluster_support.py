"""What the real-cluster tests (tests/ray_cluster_inner.py) stand on: the
cluster itself (a head and three nodes on loopback, started in the
private namespace), its constants, and the helpers the tests share: fake
GPU tools, a server on the cluster, a launcher that forges a Hello, a
fake Hub on loopback, process lookups."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from supervisor.workers.ray_launcher import RayLauncher, RayProcess
from supervisor.workers.spec import Timing, WorkerSpec
from tests.fake_hub import FakeFile, FakeHub, FakeRepo
from tests.server import REPO, Server, poll_until, short_tempdir
from worker import protocol as p

# Outside Ray's default worker port range (10002-19999).
HEAD_PORT = 6380


ADDRESS = f"127.0.0.1:{HEAD_PORT}"


TIMING = Timing(handshake_timeout=60, ping_interval=2, ping_timeout=30, kill_grace=5, backoff_min=0.5,
                backoff_max=1, crash_limit=2, crash_window=60)


# A coarse bound against hangs: how long the workers may outlive a killed parent.
ORPHAN_BOUND_S = 45.0


# Free MiB each node's fake nvidia-smi reports for its one GPU (of 24 GiB);
# None: no nvidia-smi there.
FREE_MIB: dict[str, int | None] = {"node-a": 8192, "node-b": 16384, "node-c": None}


# The head notices a dead node within seconds instead of Ray's ~30 s.
FAST_HEALTH_CHECK = {"RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "1000",
                     "RAY_health_check_failure_threshold": "3"}


@dataclass
class Cluster:
    address: str
    nodes: dict[str, str]  # node name -> node id
    start_node: Callable[[str], None]  # starts (again) the node of this name
    hf_homes: dict[str, Path]  # each node's own HF_HOME (its local Hub cache is hub/ in it)


# The Hub the nodes reach (a fake one this test serves on loopback): a fixed
# port, since the nodes' environment is set when they start. Outside Ray's ranges.
HUB_PORT = 6391


def _fake_smi(bin_dir: Path, name: str) -> None:
    """nvidia-smi's memory query, answered for one GPU with FREE_MIB[name] free."""
    bin_dir.mkdir(parents=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho '0, GPU-fake-{name}, Fake GPU, {FREE_MIB[name]}, 24576'\n")
    smi.chmod(0o755)


def _ray(*args: str, env: dict[str, str]) -> None:
    out = subprocess.run([str(Path(sys.executable).parent / "ray"), *args], env=env, capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    # Short: Ray puts Unix sockets under it.
    temp = Path(tempfile.mkdtemp(prefix="rc", dir="/tmp"))
    # The nodes' processes (agents, and the workers they start) import this tree.
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0"}
    common = ["--node-ip-address=127.0.0.1", "--num-cpus=1", f"--temp-dir={temp}"]
    try:
        _ray("start", "--head", f"--port={HEAD_PORT}", "--num-gpus=0", "--include-dashboard=false",
             "--disable-usage-stats", *common, env={**env, **FAST_HEALTH_CHECK})

        hf_homes = {name: temp / f"{name}-hf" for name in FREE_MIB}

        def start_node(name: str) -> None:
            path = env["PATH"]
            if FREE_MIB[name] is not None:
                if not (temp / name).exists():
                    _fake_smi(temp / name, name)
                path = f"{temp / name}:{path}"
            # Each node's own Hub cache, and the Hub it downloads from.
            hub = {"HF_HOME": str(hf_homes[name]), "HF_ENDPOINT": f"http://127.0.0.1:{HUB_PORT}",
                   "HF_HUB_DISABLE_XET": "1"}
            _ray("start", f"--address={ADDRESS}", "--num-gpus=1", f"--labels=gpuvisor-node={name}", *common,
                 env={**env, **hub, "PATH": path})

        for name in FREE_MIB:
            start_node(name)
        import ray

        ray.init(address=ADDRESS, log_to_driver=False)
        nodes = {n["Labels"].get("gpuvisor-node", ""): n["NodeID"] for n in ray.nodes()  # type: ignore[no-untyped-call]
                 if n["Alive"] and n["Resources"].get("GPU", 0) >= 1}
        assert set(nodes) == set(FREE_MIB), ray.nodes()  # type: ignore[no-untyped-call]
        yield Cluster(ADDRESS, nodes, start_node, hf_homes)
    finally:
        if "ray" in sys.modules:
            # A driver still connected when its raylet stops exits with an error.
            sys.modules["ray"].shutdown()
        subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"], env=env,
                       capture_output=True, timeout=120, check=False)
        shutil.rmtree(temp, ignore_errors=True)


def _agent_of(pid: int) -> psutil.Process:
    """The node agent's process: the worker's parent, a Ray actor of class NodeAgent."""
    agent = psutil.Process(pid).parent()
    assert agent is not None
    assert "NodeAgent" in " ".join(agent.cmdline()), agent.cmdline()
    return agent


def _raylet_of(node_id: str) -> psutil.Process:
    for proc in psutil.process_iter(["name", "cmdline"]):
        if proc.info["name"] == "raylet" and f"--node_id={node_id}" in (proc.info["cmdline"] or []):
            return proc
    raise AssertionError(f"no raylet of node {node_id}")


def _gpu(srv: Server) -> dict[str, dict[str, Any]]:
    """/api/gpu's devices by id."""
    r = httpx.get(srv.base_url + "/api/gpu", timeout=30)
    assert r.status_code == 200, r.text
    return {d["id"]: d for d in r.json()["devices"]}


def _cluster_server(cluster: Cluster, tiny_model_path: Path) -> Server:
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    return Server(models, env={"GPUVISOR_RAY_ADDRESS": cluster.address, "GPUVISOR_WORKER_LISTEN": "tcp:127.0.0.1",
                               "GPUVISOR_N_CTX": "2048"})


def _stream_rate(srv: Server, tokens: int) -> float:
    """Tokens per second of one streamed completion of exactly ``tokens`` tokens."""
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    usage = None
    with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: {") and '"usage"' in line:
                usage = json.loads(line[6:]).get("usage") or usage
    elapsed = time.perf_counter() - start
    assert usage is not None and usage["completion_tokens"] == tokens, usage
    return tokens / elapsed


def _running(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


class ForgingRayLauncher(RayLauncher):
    """Sends a Hello with a wrong secret to the spawn's listener before the real worker starts."""

    answer: bytes | None = None
    started: RayProcess | None = None

    async def start(self, spec: WorkerSpec, timing: Timing, address: list[str], secret: bytes,
                    stem: str) -> RayProcess:
        host, _, port = address[1].rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        body = await asyncio.wait_for(p.read_frame(reader, p.MAX_HELLO_FRAME), 10)
        assert body is not None
        challenge = p.handshake_codec().decode(body)
        assert isinstance(challenge, p.Challenge)
        nonce = secrets.token_bytes(p.NONCE_BYTES)
        forged = p.proof(secrets.token_bytes(p.SECRET_BYTES), "worker", challenge.nonce, nonce)
        writer.write(p.worker_codec().encode(p.Hello(p.PROTOCOL_VERSION, 1, nonce, forged)))
        self.answer = await asyncio.wait_for(reader.read(), 20)  # no Welcome: the end of the stream
        self.started = await super().start(spec, timing, address, secret, stem)
        return self.started


@contextmanager
def _hub_on_loopback(hub: FakeHub) -> Iterator[FakeHub]:
    """The fake Hub served from a thread of its own (these tests are synchronous)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fake-hub", daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(hub.start(HUB_PORT), loop).result(30)
        yield hub
    finally:
        asyncio.run_coroutine_threadsafe(hub.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


def _download_to_node_a(srv: Server, cluster: Cluster, tiny_model_path: Path) -> str:
    """A download job naming node-a, from the fake Hub into node-a's own cache:
    the result names node-a, the library lists the model held there, and its
    worker goes to node-a although node-b has more room. The model's id."""
    hub = FakeHub(repos={"org/Tiny-GGUF": FakeRepo({"Tiny-Q8_0.gguf": FakeFile(tiny_model_path.read_bytes())})})
    with _hub_on_loopback(hub):
        r = httpx.post(srv.base_url + "/api/jobs", timeout=60, json={
            "kind": "download", "params": {"repo_id": "org/Tiny-GGUF", "node": "node-a"}})
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        done = poll_until(lambda: _job(srv, job_id), lambda j: j["status"] not in ("queued", "running"),
                          timeout=90, interval=0.2)
    assert done["status"] == "succeeded", done
    assert done["result"]["node"] == "node-a", done["result"]
    local = Path(done["result"]["files"][0]["local_path"])
    assert local.is_relative_to(cluster.hf_homes["node-a"] / "hub") and local.is_file(), local
    assert f"job process {job_id}.log started on node node-a" in srv.log_text()
    model = done["result"]["model_id"]
    listed = {m["id"]: m for m in httpx.get(srv.base_url + "/api/models", timeout=30).json()["data"]}
    assert listed[model]["nodes"] == ["node-a"] and listed[model]["usable"], listed[model]
    # A node that is not in the cluster is a 400 naming it.
    r = httpx.post(srv.base_url + "/api/jobs", timeout=60, json={
        "kind": "download", "params": {"repo_id": "org/Tiny-GGUF", "node": "node-z"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "params.node", r.text
    assert "node-z" in r.json()["error"]["message"]
    r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=120, json={
        "model": model, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    worker = srv.worker(model)
    assert worker["devices"] == ["node-a/cuda:0"], worker
    return str(model)


def _job(srv: Server, job_id: str) -> dict[str, Any]:
    r = httpx.get(f"{srv.base_url}/api/jobs/{job_id}", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]
