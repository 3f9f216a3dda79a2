"""What a worker runs (``WorkerSpec``) and the timings that supervise it (``Timing``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class WorkerSpec:
    model_id: str
    path: Path
    embedding: bool
    n_ctx: int
    n_gpu_layers: int
    n_threads: int
    device: str = "cpu"
    cache_type: str = "f16"
    draft_ngram: int = 0
    # Requests the worker runs at once (its engine slots).
    parallel: int = 1
    # The vision projector (mmproj) to load with the model, if the library links one.
    mmproj: Path | None = None


@dataclass(frozen=True)
class Timing:
    handshake_timeout: float
    ping_interval: float
    ping_timeout: float
    kill_grace: float
    backoff_min: float
    backoff_max: float
    crash_limit: int
    crash_window: float
    heartbeat: float = 1.0
    # A load that shows no progress (worker memory not growing) for this long fails.
    load_stall_timeout: float = 60.0
