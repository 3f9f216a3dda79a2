"""What starts one job process, here or on a cluster node: its argv, the
environment the parent sets for it, and its params line.

One function for both places (job_exec.py here, node_exec.py on a node),
so that a job runs the same way wherever it runs. What differs is only the
base the environment is laid over: here the parent's allowlisted
environment (job_process.child_environ) and the path to this tree; on a
node the agent lays it over that node's own allowlisted environment
(supervisor/workers/node_agent.py), so none of the parent's machine-local
settings travel there.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec

from jobs.context import JobContext
from supervisor.lab.active import RunnerSettings
from supervisor.lab.job_process import job_settings
from supervisor.lab.job_schema import Job
from supervisor.models.devices import pinned_environ

# The runner's settings that name this machine's Hub cache: a download into
# a node's own cache leaves them out, so the node's HF_HOME (or its default)
# decides where the files land there.
HUB_CACHE_NAMES = frozenset({"HF_HUB_CACHE", "HF_HOME"})


@dataclass(frozen=True)
class JobCommand:
    # After the interpreter: ``-m jobs <kind>``.
    argv: list[str]
    # Set over the allowlisted environment of the machine it runs on.
    env: dict[str, str]
    # Its params and context, one JSON line on its stdin (which stays open).
    stdin_line: bytes


def job_command(job: Job, settings: RunnerSettings, pinned: Sequence[int] | None, *,
                own_hub_cache: bool = False, environ: Mapping[str, str] = os.environ) -> JobCommand:
    """The command for ``job``. ``pinned``: the GPU indices it may see on its
    machine (an empty list hides every GPU; None leaves the GPUs alone, on a
    machine without any). ``own_hub_cache``: leave the parent's Hub cache
    out (a download into a node's local cache). ``environ`` is the parent's,
    read for the Hugging Face token alone, which only a kind that downloads
    gets (the configured one first)."""
    extra = {k: v for k, v in settings.extra_env.items() if not (own_hub_cache and k in HUB_CACHE_NAMES)}
    env = job_settings(job.kind, environ, extra)
    if pinned is not None:
        env.update(pinned_environ(pinned))
    r = settings.roots
    context = JobContext(job_id=job.id, models_dir=str(r.models), datasets_dir=str(r.datasets),
                         outputs_dir=str(r.outputs), keepalive_s=settings.keepalive_s, attempt=job.attempt)
    line = msgspec.json.encode({"params": job.params, "context": context}) + b"\n"
    return JobCommand(["-m", "jobs", job.kind], env, line)
