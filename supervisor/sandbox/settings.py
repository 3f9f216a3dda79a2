"""The sandbox from the service's settings, and whether it can be enabled."""

from __future__ import annotations

import asyncio
import logging
import re
import sys
from pathlib import Path

from supervisor.config import Config
from supervisor.sandbox.containers import SPOOL_PREFIX, ContainerPool, remove_tree
from supervisor.sandbox.runner import SandboxLimits, SandboxSpec, probe

log = logging.getLogger(__name__)

# The names this pool makes in its root: containers' folders and uploads being written.
_CONTAINER_NAME = re.compile(r"cntr_[0-9a-f]{32}")
_SPOOL_NAME = re.compile(SPOOL_PREFIX + r"[0-9a-f]{32}")


def hidden_paths(cfg: Config) -> tuple[str, ...]:
    """What the code must not see: the state dir (the database, keys, logs,
    the workers' sockets), the models, datasets and outputs, the config
    file's folder and the Hugging Face cache."""
    paths = [cfg.state_dir, cfg.models_dir, cfg.datasets_dir, cfg.outputs_dir, *cfg.extra_model_dirs]
    if cfg.config:
        paths.append(str(Path(cfg.config).parent))
    if cfg.hf_cache_dir and cfg.hf_cache_dir != "off":
        paths.append(cfg.hf_cache_dir)
    return tuple(dict.fromkeys(str(Path(p).expanduser().resolve()) for p in paths if p))


def sandbox_spec(cfg: Config) -> SandboxSpec:
    limits = SandboxLimits(cpu_s=cfg.code_interpreter_cpu_s, memory_mib=cfg.code_interpreter_memory_mib,
                           wall_s=cfg.code_interpreter_wall_s, file_mib=cfg.code_interpreter_file_mib,
                           processes=cfg.code_interpreter_processes,
                           open_files=cfg.code_interpreter_open_files)
    return SandboxSpec(python=cfg.code_interpreter_python or sys.executable, hide=hidden_paths(cfg),
                       uid=cfg.code_interpreter_uid, gid=cfg.code_interpreter_gid, limits=limits)


def containers_root(cfg: Config) -> Path:
    return Path(cfg.code_interpreter_dir) if cfg.code_interpreter_dir else cfg.state_path / "containers"


def remove_leftovers(root: Path) -> list[str]:
    """Remove the container folders a previous run of the service left
    (their containers died with it); only names this pool makes."""
    if not root.is_dir():
        return []
    gone = [entry for entry in root.iterdir()
            if _CONTAINER_NAME.fullmatch(entry.name) and entry.is_dir() and not entry.is_symlink()]
    for entry in gone:
        remove_tree(entry)
    for entry in root.iterdir():
        if _SPOOL_NAME.fullmatch(entry.name) and entry.is_file() and not entry.is_symlink():
            entry.unlink()  # an upload cut off by the stop
    return [entry.name for entry in gone]


async def open_pool(cfg: Config) -> tuple[ContainerPool | None, str | None]:
    """(the pool, None) when the tool is enabled and the sandbox works;
    (None, why not) otherwise, for the service to log and the API to name."""
    if not cfg.code_interpreter:
        return None, "code_interpreter is not enabled (setting code_interpreter)"
    spec = sandbox_spec(cfg)
    root = containers_root(cfg)
    left = await asyncio.to_thread(remove_leftovers, root)
    if left:
        log.info("removed %d container folders of an earlier run from %s", len(left), root)
    # A container takes in (file_ids, uploads) at most what one run may write in one file.
    pool = ContainerPool(root, spec, max_containers=cfg.code_interpreter_max_containers,
                         idle_s=cfg.code_interpreter_idle_s, max_upload_bytes=cfg.code_interpreter_file_mib << 20)
    trial = pool.create()
    try:
        reason = await probe(spec, trial.path)
    finally:
        pool.remove(trial.id)
    if reason is not None:
        reason = f"code_interpreter cannot be enabled: {reason}"
        log.warning("%s; requests with the tool are refused", reason)
        return None, reason
    return pool, None

