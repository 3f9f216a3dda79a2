"""Training checkpoints: written atomically, found by their step.

A checkpoint is a directory ``checkpoint-<step>`` holding the LoRA adapter
(loadable on its own with peft), the optimizer state and ``state.json``.
It is written under a hidden temporary name, every file fsynced, and renamed
into place as the last act: a checkpoint directory exists only when it is
complete, so a save cut short by a kill leaves nothing a resume would use.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobs.context import JobError

if TYPE_CHECKING:
    import torch

_NAME = re.compile(r"^checkpoint-(\d+)$")
STATE_FILE = "state.json"


@dataclass
class TrainState:
    step: int
    total_steps: int
    epoch: float
    loss: float | None
    tokens_seen: int
    train_seconds: float


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with p.open("rb") as f:
                os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_dir_atomically(target: Path, write: Callable[[Path], None]) -> Path:
    """Fill a temp dir through ``write(tmp)``, fsync it, then rename it into
    place: a reader never sees a half-written directory under ``target``."""
    tmp = target.with_name(f".tmp-{target.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write(tmp)
        _fsync_tree(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def save_checkpoint(
    root: Path, model: Any, optimizer: torch.optim.Optimizer, state: TrainState, keep: int
) -> Path:
    import torch

    root.mkdir(parents=True, exist_ok=True)

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(torch.get_rng_state(), tmp / "rng.pt")
        (tmp / STATE_FILE).write_text(json.dumps(asdict(state)))

    final = write_dir_atomically(root / f"checkpoint-{state.step}", write)
    _prune(root, keep)
    return final


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first (temporary dirs never match)."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _NAME.match(p.name)
        if m and (p / STATE_FILE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def newest_checkpoint(root: Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def _prune(root: Path, keep: int) -> None:
    for _step, path in complete_checkpoints(root)[:-keep]:
        shutil.rmtree(path)


def load_checkpoint(path: Path, model: Any, optimizer: torch.optim.Optimizer) -> TrainState:
    """Restore adapter weights, optimizer and RNG; returns the saved state."""
    import torch
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    try:
        state = TrainState(**json.loads((path / STATE_FILE).read_text()))
        weights = load_file(str(path / "adapter_model.safetensors"))
        optim_state = torch.load(path / "optimizer.pt", weights_only=True)
        rng = torch.load(path / "rng.pt", weights_only=True)
    except (OSError, ValueError, TypeError, RuntimeError) as exc:
        raise JobError(f"checkpoint {path.name} cannot be read: {exc}") from exc
    set_peft_model_state_dict(model, weights)
    optimizer.load_state_dict(optim_state)
    torch.set_rng_state(rng)
    return state
