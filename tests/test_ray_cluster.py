"""Workers on Ray: the node agent on its own, placement, the settings, and
a real local Ray cluster (tests/ray_cluster_inner.py) run in a private
network and process namespace.

Ray binds and dials the machine's own address unless told otherwise, and
``ray stop`` ends every Ray process it can see: inside ``unshare -n -p``
the cluster has only its own loopback (``--node-ip-address=127.0.0.1``)
and sees only its own processes, and all of them end with the namespace.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import secrets
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from supervisor.app import timing_from
from supervisor.config import ConfigError, load_config
from supervisor.workers.connection import Endpoint, Listener
from supervisor.workers.handle import WorkerHandle, WorkerState
from supervisor.workers.launcher import LocalLauncher, LocalProcess, worker_argv
from supervisor.workers.node_agent import NodeAgent, UnknownWorker
from supervisor.workers.queue import Pending, WorkerGone
from supervisor.workers.ray_launcher import ClusterError, RayLauncher, _pick_node
from supervisor.workers.spec import Timing, WorkerSpec
from tests.server import REPO, short_tempdir
from worker import protocol as p

TIMING = Timing(handshake_timeout=60, ping_interval=2, ping_timeout=30, kill_grace=5, backoff_min=0.5,
                backoff_max=1, crash_limit=2, crash_window=60)

UNSHARE = ["unshare", "--net", "--pid", "--fork", "--mount-proc"]
# The namespace's first process stays a shell (it reaps the orphans the
# tests look for) and stops Ray there whatever the tests did.
INNER = ('ip link set lo up || exit 97\n'
         '"$0" -m pytest -q -p no:cacheprovider -s tests/ray_cluster_inner.py; rc=$?\n'
         '"$(dirname "$0")/ray" stop --force >/dev/null 2>&1\n'
         'exit $rc')


def _namespace_problem() -> str | None:
    try:
        out = subprocess.run([*UNSHARE, "ip", "link", "set", "lo", "up"], capture_output=True, text=True,
                             timeout=30, check=False)
    except FileNotFoundError as exc:
        return f"no unshare or ip here: {exc}"
    return None if out.returncode == 0 else f"a private network namespace is not permitted: {out.stderr.strip()}"


@pytest.mark.timeout(600)
def test_workers_on_a_local_ray_cluster_in_a_private_network() -> None:
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed (the cluster extra: pip install -e '.[cluster]')")
    problem = _namespace_problem()
    if problem is not None:
        pytest.skip(problem)
    env = {**os.environ, "GPUVISOR_RAY_NETNS": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run([*UNSHARE, "bash", "-c", INNER, sys.executable], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=570, check=False)
    report = out.stdout[-6000:] + out.stderr[-3000:]
    assert out.returncode == 0, report
    assert "8 passed" in out.stdout, report
    # The inner tests' numbers (pytest's progress dots may come first on their lines).
    print("\n".join(line[line.index("measured:"):] for line in out.stdout.splitlines() if "measured:" in line))


async def test_the_node_agent_starts_tends_and_kills_a_worker(tiny_model_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent's part, here without Ray: the worker it starts proves the
    secret it was given on stdin and loads; the node's secrets stay out of
    its environment; its memory, its exit by a signal to its group and its
    log's tail come back."""
    monkeypatch.setenv("HF_TOKEN", "hf_node_secret")
    agent = NodeAgent(str(short_tempdir("gva")))
    where = await agent.where()
    secret = secrets.token_bytes(p.SECRET_BYTES)
    listener = Listener(Endpoint.parse("tcp:127.0.0.1"), secret, "tiny")
    await listener.open(None)
    spec = WorkerSpec("tiny", tiny_model_path, False, 256, 0, 1)
    argv = worker_argv(spec, TIMING, listener.address, Path(str(where["run_dir"])) / "t.e.sock")
    pid = await agent.start(argv, {"CUDA_VISIBLE_DEVICES": "0"}, secret, "tiny.log", own_python=True)
    try:
        conn = await asyncio.wait_for(listener.proven, 60)
        ready = await asyncio.wait_for(conn.read(), 60)
        assert isinstance(ready, p.Ready), ready
        env = psutil.Process(pid).environ()
        assert "HF_TOKEN" not in env and env["CUDA_VISIBLE_DEVICES"] == "0"
        assert psutil.Process(pid).ppid() == os.getpid() and os.getpgid(pid) == pid  # its own group
        returncode, rss = await agent.status(pid)
        assert returncode is None and rss > 1 << 20
        await agent.kill(pid, signal.SIGKILL)
        assert await asyncio.wait_for(agent.wait(pid), 30) == -signal.SIGKILL
        assert await agent.status(pid) == (-signal.SIGKILL, 0)
        tail = await agent.log_tail(pid)
        assert tail.strip() and tail in (Path(str(where["log_dir"])) / "tiny.log").read_text(errors="replace")
    finally:
        listener.close()
        await agent.kill(pid, signal.SIGKILL)
        await agent.wait(pid)
        await agent.cleanup(pid)
    assert not (Path(str(where["run_dir"])) / "t.e.sock").exists()
    with pytest.raises(UnknownWorker):
        await agent.wait(pid)
    with pytest.raises(ValueError, match="a log name"):
        await agent.start(argv, {}, secret, "../elsewhere.log", own_python=True)


# A start against a cluster that does not answer, in an interpreter of its
# own (Ray keeps retrying in the background): it fails within the join's
# bound while the loop goes on (the ticks), and the service's SIGTERM handler stays.
_UNANSWERED = """
import asyncio, json, os, signal, socket, sys
from pathlib import Path
from supervisor.workers import ray_launcher as rl
from supervisor.workers.spec import Timing, WorkerSpec
rl.JOIN_TIMEOUT = 3.0
sock = socket.socket(); sock.bind(("127.0.0.1", 0)); port = sock.getsockname()[1]; sock.close()

async def main():
    ticks = 0
    def on_term(*_): pass
    signal.signal(signal.SIGTERM, on_term)
    async def tick():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.1); ticks += 1
    ticker = asyncio.create_task(tick())
    loop = asyncio.get_running_loop(); t0 = loop.time()
    try:
        await rl.RayLauncher(f"127.0.0.1:{port}", Path(".")).start(
            WorkerSpec("tiny", Path("x.gguf"), False, 256, 0, 1), Timing(60, 2, 30, 5, 0.5, 1, 2, 60), ["--tcp", "127.0.0.1:1"], b"s", "w")
        error = None
    except rl.ClusterError as exc:
        error = str(exc)
    ticker.cancel()
    print(json.dumps({"error": error, "s": loop.time() - t0, "ticks": ticks,
                      "handler": signal.getsignal(signal.SIGTERM) is on_term}))
    sys.stdout.flush(); os._exit(0)

asyncio.run(main())
"""


def test_a_cluster_that_does_not_answer_fails_the_start_in_bounded_time() -> None:
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed (the cluster extra: pip install -e '.[cluster]')")
    out = subprocess.run([sys.executable, "-c", _UNANSWERED], cwd=REPO, capture_output=True, text=True,
                         timeout=90, check=False, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["error"] and "no answer from the Ray cluster" in got["error"], got
    assert got["s"] < 30 and got["ticks"] >= 20, got  # the loop ran on meanwhile
    assert got["handler"] is True


class _OnNode:
    """A local worker standing for one on a node: ``host_lost`` says when its node's agent is gone."""

    def __init__(self, started: LocalProcess) -> None:
        self.started = started
        self.host_lost = False

    @property
    def pid(self) -> int:
        return self.started.pid

    @property
    def returncode(self) -> int | None:
        return self.started.returncode

    async def wait(self) -> int:
        return await self.started.wait()

    def kill(self, sig: int) -> None:
        self.started.kill(sig)

    def rss(self) -> int:
        return self.started.rss()

    def log_tail(self) -> str:
        return self.started.log_tail()

    def cleanup(self) -> None:
        self.started.cleanup()


class _NodeLauncher:
    """The local launcher's processes, as _OnNode."""

    def __init__(self, run_dir: Path, log_dir: Path) -> None:
        self.local = LocalLauncher(run_dir, log_dir)
        self.started: _OnNode | None = None

    def log_path(self, spec: WorkerSpec) -> Path:
        return self.local.log_path(spec)

    async def start(self, spec: WorkerSpec, timing: Timing, address: list[str], secret: bytes,
                    stem: str) -> _OnNode:
        self.started = _OnNode(await self.local.start(spec, timing, address, secret, stem))
        return self.started


async def _held_request_on_a_lost_node(tiny_model_path: Path,
                                       timing: Timing = TIMING) -> tuple[WorkerHandle, Pending]:
    """A handle whose worker took a request and then died with its node (held still, then SIGKILLed)."""
    run, logs = short_tempdir(), short_tempdir()
    launcher = _NodeLauncher(run, logs)
    handle = WorkerHandle(WorkerSpec("tiny", tiny_model_path, False, 256, 0, 1), timing, run, logs, 8,
                          launcher=launcher, endpoint=Endpoint.parse("unix"))
    handle.start()
    await asyncio.wait_for(handle.ready.wait(), 90)
    assert launcher.started is not None and handle.pid is not None
    os.kill(handle.pid, signal.SIGSTOP)  # it cannot answer before its node goes
    pend = handle.submit(p.Generate(0, p.SamplingParams(max_tokens=200, temperature=0.0), prompt="once"))
    launcher.started.host_lost = True
    os.kill(handle.pid, signal.SIGKILL)
    return handle, pend


async def test_requests_on_a_worker_gone_with_its_node_end_with_node_lost_once_the_cluster_says_so(
        tiny_model_path: Path) -> None:
    handle, pend = await _held_request_on_a_lost_node(tiny_model_path)
    try:
        # Its connection broke and its process is gone: the request waits for the cluster's verdict...
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(pend.events.get(), 3)
        assert handle.state is WorkerState.CRASHED
    finally:
        # ...which is the pool's stop for the node's loss (supervisor/workers/node_loss.py).
        await handle.stop("node node-b left the cluster", "node_lost")
    event = await asyncio.wait_for(pend.events.get(), 10)
    assert isinstance(event, WorkerGone) and event.code == "node_lost", event
    assert event.message == "node node-b left the cluster"
    # A node that is never declared gone (only its agent died): after the bound (the
    # node_verdict_s setting), a crash as before.
    handle, pend = await _held_request_on_a_lost_node(tiny_model_path, replace(TIMING, node_verdict_s=0.5))
    try:
        event = await asyncio.wait_for(pend.events.get(), 30)
        assert isinstance(event, WorkerGone) and event.code == "worker_crashed", event
    finally:
        await handle.stop()


def test_a_worker_goes_to_the_first_alive_node_with_its_gpus() -> None:
    nodes = [{"NodeID": "head", "Alive": True, "Resources": {"CPU": 8.0}},
             {"NodeID": "gone", "Alive": False, "Resources": {"GPU": 4.0}},
             {"NodeID": "one", "Alive": True, "Resources": {"GPU": 1.0}},
             {"NodeID": "two", "Alive": True, "Resources": {"GPU": 2.0}}]
    assert _pick_node(nodes, 1) == "one"
    assert _pick_node(nodes, 2) == "two"
    with pytest.raises(ClusterError, match=r"no alive node of the cluster \(3 alive\) has 4 GPUs"):
        _pick_node(nodes, 4)


async def test_a_cluster_needs_workers_that_dial_back_over_tcp(tmp_path: Path, tiny_model_path: Path) -> None:
    with pytest.raises(ConfigError, match="ray_address needs worker_listen"):
        load_config(environ={"GPUVISOR_RAY_ADDRESS": "10.0.0.5:6380", "GPUVISOR_STATE_DIR": str(tmp_path)})
    cfg = load_config(environ={"GPUVISOR_RAY_ADDRESS": "10.0.0.5:6380", "GPUVISOR_WORKER_LISTEN": "tcp:10.0.0.1",
                               "GPUVISOR_STATE_DIR": str(tmp_path)})
    assert cfg.ray_address == "10.0.0.5:6380"
    # The wait for the cluster's verdict on a lost node is a setting: 30 s unless set, never 0.
    assert cfg.node_verdict_s == 30.0 and timing_from(cfg).node_verdict_s == 30.0
    tuned = load_config(environ={"GPUVISOR_NODE_VERDICT_S": "5", "GPUVISOR_STATE_DIR": str(tmp_path)})
    assert tuned.node_verdict_s == 5.0 and timing_from(tuned).node_verdict_s == 5.0
    with pytest.raises(ConfigError, match="node_verdict_s"):
        load_config(environ={"GPUVISOR_NODE_VERDICT_S": "0", "GPUVISOR_STATE_DIR": str(tmp_path)})
    # The launcher's own guard, before it touches the cluster.
    with pytest.raises(ClusterError, match="over TCP"):
        await RayLauncher("10.0.0.5:6380", tmp_path).start(
            WorkerSpec("tiny", tiny_model_path, False, 256, 0, 1), TIMING, ["--socket", "x.sock"], b"s", "w")
