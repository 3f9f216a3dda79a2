"""The runner's settings and its record of one active job."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from jobs.events import Done, Failed
from jobs.kinds import KindSpec
from jobs.params import Roots
from supervisor.lab.job_schema import DEFAULT_RETENTION_S, Job

StopReason = Literal["cancel", "shutdown", "heartbeat"]


@dataclass(frozen=True)
class RunnerSettings:
    state_dir: Path
    roots: Roots
    python: str = sys.executable
    # None: one job per lease device.
    max_concurrent: int | None = None
    # Per-kind SIGTERM -> SIGKILL grace; kinds not listed use their KindSpec's.
    grace_s: Mapping[str, float] = field(default_factory=dict)
    heartbeat_timeout_s: float = 120.0
    keepalive_s: float = 5.0
    # At shutdown: how long jobs get to checkpoint and stop before SIGKILL.
    stop_timeout_s: float = 10.0
    max_line_bytes: int = 1 << 20
    log_tail_bytes: int = 2000
    retention_s: float = DEFAULT_RETENTION_S
    prune_interval_s: float = 3600.0
    # The most of a node job's log copied here while it runs (node_log.py);
    # past it, the rest stays on the node and its tail comes at the end.
    node_log_max_bytes: int = 1 << 20
    # Extra environment for job processes (e.g. HF_TOKEN, HF_HUB_CACHE).
    extra_env: Mapping[str, str] = field(default_factory=dict)

    @property
    def logs_dir(self) -> Path:
        return self.state_dir / "jobs"


@dataclass(eq=False)
class ActiveJob:
    """What the runner knows of one job it picked, from its lease wait to its end."""

    job: Job
    spec: KindSpec
    stop_reason: StopReason | None = None
    stop_requested: asyncio.Event = field(default_factory=asyncio.Event)
    pgid: int | None = None
    # A job on a cluster node: signals its group there (None: ``pgid`` is a local group).
    send: Callable[[int], None] | None = None
    # Stop with SIGUSR1 (save a checkpoint first) rather than SIGTERM.
    save: bool = False
    terminal: Done | Failed | None = None
    grace: float | None = None
    task: asyncio.Task[None] | None = None
    killer: asyncio.Task[None] | None = None
