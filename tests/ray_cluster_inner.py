"""Workers on a real Ray cluster, run by tests/test_ray_cluster.py inside a
private network (and process) namespace: a head with no GPUs and a node with
one logical GPU, both on loopback. Not collected on its own (its name is no
test_*.py); run outside that namespace it skips.

- A handle's worker is started by the node agent on the GPU node, serves a
  stream, and a forged Hello sent to the spawn's TCP listener first is refused.
- A whole server on the cluster streams a chat through a worker on the GPU
  node; SIGKILLed, it leaves neither that worker nor its agent running.
- A server stopped by SIGTERM exits cleanly and its worker on the node ends.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from supervisor.workers.connection import Endpoint
from supervisor.workers.handle import WorkerHandle, WorkerState
from supervisor.workers.queue import WorkerGone
from supervisor.workers.ray_launcher import RayLauncher, RayProcess
from supervisor.workers.spec import Timing, WorkerSpec
from tests.server import REPO, Server, poll_until, running, short_tempdir
from worker import protocol as p

pytestmark = [
    pytest.mark.skipif(os.environ.get("GPUVISOR_RAY_NETNS") != "1",
                       reason="runs only inside the private namespace tests/test_ray_cluster.py makes"),
    # Coarse, against hangs: the two nodes start in ~20 s, but on a loaded machine in minutes.
    pytest.mark.timeout(200),
]

# Outside Ray's default worker port range (10002-19999).
HEAD_PORT = 6380
ADDRESS = f"127.0.0.1:{HEAD_PORT}"
TIMING = Timing(handshake_timeout=60, ping_interval=2, ping_timeout=30, kill_grace=5, backoff_min=0.5,
                backoff_max=1, crash_limit=2, crash_window=60)
# A coarse bound against hangs: how long the workers may outlive a killed parent.
ORPHAN_BOUND_S = 45.0


@dataclass
class Cluster:
    address: str
    gpu_node: str  # the node id of the one node with a GPU


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
             "--disable-usage-stats", *common, env=env)
        _ray("start", f"--address={ADDRESS}", "--num-gpus=1", *common, env=env)
        import ray

        ray.init(address=ADDRESS, log_to_driver=False)
        gpu_nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU", 0) >= 1]
        assert len(gpu_nodes) == 1, ray.nodes()
        yield Cluster(ADDRESS, gpu_nodes[0])
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


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
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


async def test_a_node_agent_starts_a_worker_that_serves_and_a_forged_hello_is_refused(
        cluster: Cluster, tiny_model_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "gpuvisor.worker")
    run, logs = short_tempdir(), short_tempdir()
    launcher = ForgingRayLauncher(cluster.address, logs)
    spec = WorkerSpec("tiny", tiny_model_path, False, 256, 0, 1)
    handle = WorkerHandle(spec, TIMING, run, logs, 8, launcher=launcher, endpoint=Endpoint.parse("tcp:127.0.0.1"))
    handle.start()
    try:
        await asyncio.wait_for(handle.ready.wait(), 90)
        assert launcher.answer == b""
        assert any("proves no secret" in r.getMessage() for r in caplog.records), caplog.text
        assert f"started on node {cluster.gpu_node[:12]}" in caplog.text
        assert handle.pid is not None
        agent = _agent_of(handle.pid)
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
    (node_agent,) = launcher._agents.values()
    with pytest.raises(Exception, match=f"no worker with pid {pid}"):
        await asyncio.wait_for(node_agent.actor.wait.remote(pid), 30)


def test_a_chat_streams_through_a_node_and_a_killed_parent_leaves_no_worker(
        cluster: Cluster, tiny_model_path: Path) -> None:
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    srv = Server(models, env={"GPUVISOR_RAY_ADDRESS": cluster.address, "GPUVISOR_WORKER_LISTEN": "tcp:127.0.0.1"})
    with running(srv):
        body = {"model": "tiny", "stream": True, "max_tokens": 6, "temperature": 0,
                "messages": [{"role": "user", "content": "hello"}]}
        lines = []
        with httpx.stream("POST", srv.base_url + "/v1/chat/completions", json=body, timeout=120) as resp:
            assert resp.status_code == 200, resp.read()
            lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        assert any(c["choices"] and c["choices"][0]["delta"].get("content") for c in chunks), chunks
        pid = int(srv.worker()["pid"])
        assert re.search(rf"worker tiny started on node {cluster.gpu_node[:12]} \(pid {pid},", srv.log_text())
        agent = _agent_of(pid)
        assert srv.proc is not None
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait(10)
        killed = time.monotonic()
        poll_until(lambda: (_running(pid), _running(agent.pid)), lambda alive: alive == (False, False),
                   timeout=ORPHAN_BOUND_S, interval=0.2)
        print(f"worker and agent gone {time.monotonic() - killed:.1f}s after the parent's SIGKILL")


def test_a_stopped_parent_stops_its_workers_on_the_nodes(cluster: Cluster, tiny_model_path: Path) -> None:
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    srv = Server(models, env={"GPUVISOR_RAY_ADDRESS": cluster.address, "GPUVISOR_WORKER_LISTEN": "tcp:127.0.0.1"})
    with running(srv):
        r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=120, json={
            "model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
        pid = int(srv.worker()["pid"])
        assert _running(pid)
        # The service's own stop (systemctl stop): the worker is shut down, the driver leaves.
        assert srv.stop(signal.SIGTERM, timeout=60) == 0, srv.log_text()[-3000:]
        poll_until(lambda: _running(pid), lambda alive: not alive, timeout=ORPHAN_BOUND_S, interval=0.2)
