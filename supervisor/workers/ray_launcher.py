"""Workers on the nodes of a Ray cluster: the ``RayLauncher``.

With ``ray_address`` set, the parent joins the cluster as a driver (Ray is
imported then, and only then) and starts each worker through the node
agent of the node it picks (supervisor/workers/node_agent.py): one agent
per node, a Ray actor pinned there with ``NodeAffinitySchedulingStrategy``
and no CPU booked. The parent creates the agents and so owns them (they are
not detached): when the parent dies, Ray ends its agents, the agents' ends
of the workers' stdin close, and the workers exit. The worker dials back to
the parent's listener over TCP (``worker_listen = "tcp:HOST"``) and proves
the spawn's secret there, as on one machine.

Placement is the parent's: a worker's devices name their node
(``node-a/cuda:0``, supervisor/workers/cluster_nodes.py lists the nodes and
their GPUs), and the launcher starts it on that node, pinned to those GPUs'
indices there. A spec that names no node (devices of this machine) goes to
the first alive node whose logical GPUs (``ray start --num-gpus``) number at
least its GPUs, and at least one: a node started with ``--num-gpus=0`` (a
head that serves nothing) gets no worker.

A node's name is its ``gpuvisor-node`` label (``ray start --labels
gpuvisor-node=node-a``), else its host name; a name another alive node has
already gets the start of the node's id after it. A node keeps its name
while it is alive.

Jobs run there too (:meth:`RayLauncher.start_job`, for the job runner's
supervisor/lab/node_exec.py): the node's agent starts ``python -m jobs``
and the parent polls it for the job's stdout (:class:`RayNodeJob`). An
agent that no longer answers (its node gone) is a lost job:
:class:`~supervisor.lab.node_jobs.NodeJobLost`.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.lab.node_jobs import NodeJobLost
from supervisor.models.gpu_reading import device_node
from supervisor.workers.crash import worker_log_path
from supervisor.workers.launcher import Launcher, worker_argv, worker_environ
from supervisor.workers.node_hub import Removal
from supervisor.workers.spec import Timing, WorkerSpec

log = logging.getLogger("gpuvisor.worker")

# How often the parent reads a remote worker's memory (load progress).
RSS_POLL_S = 0.25
# Bounds on calls to an agent that should answer at once; an agent that
# does not is on a node that is gone or stuck.
AGENT_CALL_TIMEOUT = 30.0
# A memory reading waits less: the next one comes within seconds.
READ_TIMEOUT = 10.0
# The exit status reported when the agent (its node) is gone: its workers
# lost their stdin and were SIGKILLed or exited.
GONE_STATUS = -signal.SIGKILL
# How long a start waits for the parent to join the cluster.
JOIN_TIMEOUT = 60.0
# The signals the service stops and reloads on (supervisor/service/serving.py).
SERVICE_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# The node label that names a node in device ids.
NAME_LABEL = "gpuvisor-node"


class ClusterError(OSError):
    """The cluster could not place or start a worker (the handle retries)."""


@dataclass(frozen=True)
class ClusterNode:
    """An alive node as the cluster lists it: its id, its name in device ids,
    and its logical GPUs (``ray start --num-gpus``)."""

    node_id: str
    name: str
    gpus: int


@dataclass
class _Agent:
    node_id: str
    actor: Any  # a Ray actor handle: Ray's types stay out of the parent's imports
    run_dir: Path
    pid: int


def launcher_for(ray_address: str, log_dir: Path) -> Launcher | None:
    """The launcher the setting asks for: None (the local one) without a cluster."""
    return RayLauncher(ray_address, log_dir) if ray_address else None


class RayLauncher:
    def __init__(self, address: str, log_dir: Path) -> None:
        self.address = address
        self.log_dir = log_dir
        self._ray: Any = None
        self._joining: asyncio.Future[Any] | None = None
        self._agents: dict[str, _Agent] = {}
        # One per node: creating an agent on a node that is going away waits
        # for Ray's answer, which must not hold up starts and readings elsewhere.
        self._locks: dict[str, asyncio.Lock] = {}
        # Node id -> its name, kept while the node is alive (device ids hold it).
        self._names: dict[str, str] = {}
        # The alive nodes by name, as last listed.
        self._alive: dict[str, ClusterNode] = {}

    def log_path(self, spec: WorkerSpec) -> Path:
        # The worker's log lives on its node; its lines come back with a crash.
        return worker_log_path(self.log_dir, spec.model_id, spec.embedding)

    async def start(self, spec: WorkerSpec, timing: Timing, address: list[str], secret: bytes,
                    stem: str) -> RayProcess:
        if "--tcp" not in address:
            raise ClusterError('workers on cluster nodes dial back over TCP: set worker_listen = "tcp:HOST"')
        node = _spec_node(spec)
        if node:
            agent = await self._agent_on(await self._node_id(node))
        else:
            agent = await self._agent(_gpus_needed(spec))
        engine_socket = agent.run_dir / f"{stem}.e.sock"
        argv = worker_argv(spec, timing, address, engine_socket)
        log_name = self.log_path(spec).name
        try:
            pid: int = await _bounded(agent.actor.start.remote(argv, worker_environ(spec), secret, log_name,
                                                              not spec.python))
        except ClusterError:
            self._forget(agent)
            raise
        log.info("worker %s started on node %s (%s; pid %d, agent pid %d)", spec.model_id, agent.node_id[:12],
                 self._names.get(agent.node_id, "?"), pid, agent.pid)
        return RayProcess(agent, pid, self._ray, lambda: self._forget(agent))

    async def start_job(self, node: str, argv: list[str], env: dict[str, str], stdin_line: bytes,
                        log_name: str) -> RayNodeJob:
        """Start a job process on the node of this name through its agent."""
        agent = await self._agent_on(await self._node_id(node))
        try:
            pid: int = await _bounded(agent.actor.start_job.remote(argv, env, stdin_line, log_name))
        except ClusterError:
            self._forget(agent)
            raise
        log.info("job process %s started on node %s (pid %d, agent pid %d)", log_name, node, pid, agent.pid)
        return RayNodeJob(agent, node, pid, self._ray, lambda: self._forget(agent))

    async def read_model(self, node: str, path: str) -> bytes:
        """The GGUF header of a file on the node of this name, read by its agent there."""
        agent = await self._agent_on(await self._node_id(node))
        header: bytes = await _bounded(agent.actor.read_model.remote(path))
        return header

    async def check_hub_files(self, node: str, paths: list[str]) -> dict[str, list[str]]:
        """Which of these files of the node's own Hub cache are there (its agent checks)."""
        agent = await self._agent_on(await self._node_id(node))
        found: dict[str, list[str]] = await _bounded(agent.actor.check_hub_files.remote(paths))
        return found

    async def remove_hub_files(self, node: str, paths: list[str]) -> Removal:
        """Remove these files of the node's own Hub cache (its agent bounds them to it)."""
        agent = await self._agent_on(await self._node_id(node))
        done: Removal = await _bounded(agent.actor.remove_hub_files.remote(paths))
        return done

    def _forget(self, agent: _Agent) -> None:
        """A lost agent: the next start on its node makes a new one."""
        if self._agents.get(agent.node_id) is agent:
            del self._agents[agent.node_id]

    async def _connect(self) -> Any:
        """Ray, joined to the cluster. The join runs in a thread, once: a
        cluster that does not answer keeps Ray retrying for minutes, and the
        service must go on serving meanwhile."""
        if self._joining is None:
            # ray.init may set its own SIGTERM handler (sys.exit, mid-loop) and
            # Ray's native crash handler; the service's own handlers must stay,
            # or a stop skips the service's shutdown.
            handlers = {sig: signal.getsignal(sig) for sig in SERVICE_SIGNALS}
            self._joining = _in_daemon_thread(self._join)
            self._joining.add_done_callback(lambda _: _restore(handlers))
        try:
            async with asyncio.timeout(JOIN_TIMEOUT):
                return await asyncio.shield(self._joining)
        except TimeoutError as exc:
            raise ClusterError(f"no answer from the Ray cluster at {self.address} within {JOIN_TIMEOUT:g}s "
                               "(still trying)") from exc
        except ClusterError:
            self._joining = None  # the next start tries again
            raise

    def _join(self) -> Any:
        import ray  # only with a cluster configured: the parent imports no Ray otherwise

        try:
            # The workers' output stays in their logs on their nodes.
            ray.init(address=self.address, namespace="gpuvisor", log_to_driver=False,
                     configure_logging=False, ignore_reinit_error=True)
        except Exception as exc:
            raise ClusterError(f"cannot join the Ray cluster at {self.address}: {exc}") from exc
        self._ray = ray
        return ray

    async def alive_nodes(self) -> list[ClusterNode]:
        """The cluster's alive nodes, named (joining the cluster first)."""
        ray = await self._connect()
        listed: list[dict[str, Any]] = await _bounded(_in_daemon_thread(ray.nodes))
        alive = [n for n in listed if n.get("Alive")]
        ids = {str(n["NodeID"]) for n in alive}
        self._names = {i: name for i, name in self._names.items() if i in ids}
        nodes = []
        for n in alive:
            node_id = str(n["NodeID"])
            if node_id not in self._names:
                self._names[node_id] = _name_for(n, set(self._names.values()))
            nodes.append(ClusterNode(node_id, self._names[node_id], int(float(n.get("Resources", {}).get("GPU", 0)))))
        self._alive = {n.name: n for n in nodes}
        for node_id in [i for i in self._agents if i not in ids]:
            del self._agents[node_id]  # its node is gone, and the agent with it
        self._locks = {i: lock for i, lock in self._locks.items() if i in ids or lock.locked()}
        return nodes

    async def node_names(self) -> list[str]:
        """The alive nodes' names (a job's ``node`` param is checked against them)."""
        return [n.name for n in await self.alive_nodes()]

    async def read_node(self, node_id: str) -> dict[str, Any]:
        """The node agent's memory reading there (node_agent.NodeAgent.read_memory)."""
        agent = await self._agent_on(node_id)
        try:
            reading: dict[str, Any] = await _bounded(agent.actor.read_memory.remote(), READ_TIMEOUT)
        except ClusterError as exc:
            # The agent answered with its node's failure (its GPU tool's): it stays.
            if not isinstance(exc.__cause__, self._ray.exceptions.RayTaskError):
                self._forget(agent)  # gone or stuck: a new agent for the next call, if the node lives
            raise
        return reading

    async def _node_id(self, name: str) -> str:
        """The id of the alive node of this name (listed afresh if not known)."""
        node = self._alive.get(name)
        if node is None:
            await self.alive_nodes()
            node = self._alive.get(name)
        if node is None:
            raise ClusterError(f"node {name} is not in the cluster (alive: {', '.join(self._alive) or 'none'})")
        return node.node_id

    async def _agent(self, gpus: int) -> _Agent:
        ray = await self._connect()
        node_id = _pick_node(await _bounded(_in_daemon_thread(ray.nodes)), gpus)
        return await self._agent_on(node_id)

    async def _agent_on(self, node_id: str) -> _Agent:
        """The agent of this node, created there if it has none (once: the node's lock)."""
        ray = await self._connect()
        async with self._locks.setdefault(node_id, asyncio.Lock()):
            agent = self._agents.get(node_id)
            return agent if agent is not None else await self._new_agent(ray, node_id)

    async def _new_agent(self, ray: Any, node_id: str) -> _Agent:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from supervisor.workers.node_agent import NodeAgent

        actor = ray.remote(NodeAgent).options(
            num_cpus=0, max_restarts=0, max_concurrency=1000,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
        try:
            where = await _bounded(actor.where.remote())
        except BaseException:
            # Not answered (its node going away, or this start cancelled): none is left waiting there.
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:  # noqa: BLE001 - the original failure is the one to raise, this one is logged
                log.warning("could not end an unanswered node agent on %s: %s", node_id[:12], exc)
            raise
        agent = self._agents[node_id] = _Agent(node_id, actor, Path(str(where["run_dir"])), int(where["pid"]))
        log.info("node agent on %s (%s): pid %d", node_id[:12], where["host"], agent.pid)
        return agent


class RayProcess:
    """A worker process on a cluster node, tended by that node's agent."""

    def __init__(self, agent: _Agent, pid: int, ray: Any, on_agent_lost: Callable[[], None]) -> None:
        self._agent = agent
        self._on_agent_lost = on_agent_lost
        self._pid = pid
        self._ray = ray
        self._returncode: int | None = None
        self._rss = 0
        self._tail = ""
        self._agent_lost = False
        self._exited = asyncio.Event()
        self._watch = asyncio.create_task(self._follow(), name=f"ray-worker:{pid}")

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def returncode(self) -> int | None:
        return self._returncode

    async def wait(self) -> int:
        await self._exited.wait()
        assert self._returncode is not None
        return self._returncode

    def kill(self, sig: int) -> None:
        if self._returncode is None:
            # Fire and forget: the exit comes back through wait().
            self._agent.actor.kill.remote(self._pid, sig)

    def rss(self) -> int:
        return self._rss

    def log_tail(self) -> str:
        return self._tail

    @property
    def host_lost(self) -> bool:
        return self._agent_lost

    def cleanup(self) -> None:
        self._watch.cancel()
        if self._returncode is not None and not self._agent_lost:
            self._agent.actor.cleanup.remote(self._pid)

    async def _follow(self) -> None:
        """Read the worker's memory until it exits, then its exit status and its log's tail."""
        exit_ref = self._agent.actor.wait.remote(self._pid)
        code: int = GONE_STATUS
        try:
            done = asyncio.ensure_future(exit_ref)
            while not done.done():
                try:
                    _, self._rss = await _bounded(self._agent.actor.status.remote(self._pid))
                except ClusterError:
                    pass  # the exit, or the agent's loss, comes through ``done``
                await asyncio.wait({done}, timeout=RSS_POLL_S)
            code = int(done.result())
            self._tail = await _bounded(self._agent.actor.log_tail.remote(self._pid))
        except (ClusterError, self._ray.exceptions.RayError) as exc:
            # The agent died (its node left, or Ray ended it): its workers lost their stdin.
            self._tail = self._tail or f"the node agent on {self._agent.node_id[:12]} is gone: {exc}"
            self._agent_lost = True
            self._on_agent_lost()
            log.warning("worker pid %d: %s", self._pid, self._tail)
        finally:
            self._rss = 0
            self._returncode = code
            self._exited.set()


class RayNodeJob:
    """A job process on a cluster node, tended by that node's agent."""

    def __init__(self, agent: _Agent, node: str, pid: int, ray: Any, on_agent_lost: Callable[[], None]) -> None:
        self._agent = agent
        self._node = node
        self._pid = pid
        self._ray = ray
        self._on_agent_lost = on_agent_lost
        self._lost = False
        self._reaped = False
        # Since when the agent has been unreachable without being known dead (None: it answers).
        self._unreachable_since: float | None = None

    @property
    def pid(self) -> int:
        return self._pid

    async def read(self, wait_s: float) -> tuple[bytes, int | None]:
        loop = asyncio.get_running_loop()
        try:
            got: tuple[bytes, int | None] = await _bounded(self._agent.actor.read_job.remote(self._pid, wait_s),
                                                           wait_s + AGENT_CALL_TIMEOUT)
        except ClusterError as exc:
            cause = exc.__cause__
            if isinstance(cause, self._ray.exceptions.RayTaskError):
                raise  # the agent answered with its own failure: not a lost node
            if isinstance(cause, self._ray.exceptions.ActorUnavailableError):
                # Unreachable for now (a network blip), not dead: its job may still run there,
                # so it is lost only once that lasts.
                since = self._unreachable_since = self._unreachable_since or loop.time()
                if loop.time() - since < AGENT_CALL_TIMEOUT:
                    await asyncio.sleep(min(wait_s, 1.0))
                    return b"", None
            self._lost = True
            self._on_agent_lost()
            raise NodeJobLost(f"node {self._node} was lost while the job ran ({exc})") from exc
        self._unreachable_since = None
        return got

    def signal(self, sig: int) -> None:
        if not (self._lost or self._reaped):
            # Fire and forget: the job's end comes back through read().
            self._agent.actor.signal_job.remote(self._pid, sig)

    async def read_log(self, offset: int, max_bytes: int) -> bytes:
        if self._lost:
            return b""
        got: bytes = await _bounded(self._agent.actor.read_job_log.remote(self._pid, offset, max_bytes))
        return got

    async def log_tail(self) -> str:
        if self._lost:
            return ""
        tail: str = await _bounded(self._agent.actor.job_log_tail.remote(self._pid))
        return tail

    async def cleanup(self) -> None:
        self._reaped = True  # its pid may be another process's there from now on
        if not self._lost:
            await _bounded(self._agent.actor.cleanup_job.remote(self._pid))


def _in_daemon_thread(call: Callable[[], Any]) -> asyncio.Future[Any]:
    """``call()`` in a thread of its own, as a future of this loop. A daemon
    thread: a Ray call that hangs (a cluster gone) must not hold up the exit."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return  # nobody waits any more (the loop's caller gave up)
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        result, error = None, None
        try:
            result = call()
        except Exception as exc:  # noqa: BLE001 - handed to the awaiting caller, not swallowed
            error = exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:
            pass  # the loop is closed: nobody waits for this call any more

    threading.Thread(target=run, name="ray-call", daemon=True).start()
    return future


def _restore(handlers: dict[signal.Signals, Any]) -> None:
    """Put back the signal handlers the service had (on the loop's thread, the main one)."""
    for sig, handler in handlers.items():
        if handler is not None:  # None: set outside Python, nothing to put back
            signal.signal(sig, handler)


def _spec_node(spec: WorkerSpec) -> str:
    """The node a spec's devices are on ("" for this machine's devices)."""
    nodes = {device_node(d) for d in spec.devices}
    if len(nodes) > 1:
        raise ClusterError(f"a worker runs on one node; its devices are on {', '.join(sorted(nodes))}")
    return nodes.pop() if nodes else ""


def _name_for(node: dict[str, Any], taken: set[str]) -> str:
    """A node's name in device ids: its label, else its host name; the start
    of its id after it when another node has that name."""
    labels = node.get("Labels") or {}
    name = str(labels.get(NAME_LABEL) or node.get("NodeManagerHostname") or "node")
    name = name.replace("/", "-")  # a device id's node ends at its slash
    return f"{name}-{str(node['NodeID'])[:8]}" if name in taken else name


def _gpus_needed(spec: WorkerSpec) -> int:
    return max(1, len(spec.gpu_indices or ()))


def _pick_node(nodes: list[dict[str, Any]], gpus: int) -> str:
    """The first alive node with at least ``gpus`` logical GPUs."""
    for node in nodes:
        if node.get("Alive") and float(node.get("Resources", {}).get("GPU", 0)) >= gpus:
            return str(node["NodeID"])
    alive = sum(1 for n in nodes if n.get("Alive"))
    raise ClusterError(f"no alive node of the cluster ({alive} alive) has {gpus} GPU{'s' if gpus > 1 else ''}")


async def _bounded(ref: Any, timeout: float = AGENT_CALL_TIMEOUT) -> Any:
    """Await a call to an agent, within ``timeout``; ClusterError when it fails or is late."""
    try:
        async with asyncio.timeout(timeout):
            return await ref
    except TimeoutError as exc:
        raise ClusterError(f"the node agent did not answer within {timeout:g}s") from exc
    except Exception as exc:
        if isinstance(exc, ClusterError):
            raise
        raise ClusterError(f"the node agent failed: {type(exc).__name__}: {exc}") from exc
