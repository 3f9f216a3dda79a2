"""Cluster nodes for the job runner without Ray: ``AgentNodes`` answers the
runner's JobNodes (supervisor/lab/node_jobs.py) with real NodeAgents in
this process (the part that runs on a node), so a job process is real and
started by the agent's code. A node lost is the agent's end as the node
sees it: the job's stdin closes, and the agent no longer answers. The Ray
transport between them is the real-cluster test's (tests/ray_cluster_inner.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from supervisor.lab.node_jobs import NodeJobLost
from supervisor.workers.node_agent import NodeAgent
from supervisor.workers.node_hub import Removal


@dataclass
class AgentJob:
    agent: NodeAgent
    node: str
    pid: int
    lost: bool = False

    async def read(self, wait_s: float) -> tuple[bytes, int | None]:
        got = await self.agent.read_job(self.pid, wait_s)
        if self.lost:
            # A gone agent's answers never arrive, even one asked for before.
            raise NodeJobLost(f"node {self.node} was lost while the job ran (its agent is gone)")
        return got

    def signal(self, sig: int) -> None:
        if not self.lost:
            self.agent._job(self.pid)  # a pid it no longer tends is never signalled
            os.killpg(self.pid, sig)

    async def read_log(self, offset: int, max_bytes: int) -> bytes:
        return await self.agent.read_job_log(self.pid, offset, max_bytes)

    async def log_tail(self) -> str:
        return await self.agent.job_log_tail(self.pid)

    async def cleanup(self) -> None:
        await self.agent.cleanup_job(self.pid)


@dataclass
class AgentNodes:
    agents: dict[str, NodeAgent]
    started: list[AgentJob] = field(default_factory=list)
    # Each removal asked of a node's agent: (node, paths).
    removals: list[tuple[str, list[str]]] = field(default_factory=list)

    async def node_names(self) -> list[str]:
        return list(self.agents)

    async def read_model(self, node: str, path: str) -> bytes:
        return await self.agents[node].read_model(path)

    async def check_hub_files(self, node: str, paths: list[str]) -> dict[str, list[str]]:
        return await self._agent(node).check_hub_files(paths)

    async def remove_hub_files(self, node: str, paths: list[str]) -> Removal:
        self.removals.append((node, paths))
        return await self._agent(node).remove_hub_files(paths)

    def _agent(self, node: str) -> NodeAgent:
        agent = self.agents.get(node)
        if agent is None:
            raise OSError(f"node {node} is not in the cluster")
        return agent

    async def start_job(self, node: str, argv: list[str], env: dict[str, str], stdin_line: bytes,
                        log_name: str) -> AgentJob:
        agent = self.agents.get(node)
        if agent is None:
            raise OSError(f"node {node} is not in the cluster")
        job = AgentJob(agent, node, await agent.start_job(argv, env, stdin_line, log_name))
        self.started.append(job)
        return job

    def lose(self, job: AgentJob) -> None:
        """The agent's process ends: its end of the job's stdin closes."""
        stdin = job.agent._jobs[job.pid].proc.stdin
        assert stdin is not None
        stdin.close()
        job.lost = True
