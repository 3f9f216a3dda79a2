"""Read-only views of the pool's workers: what ``/api/models``, ``/api/ps``,
the metrics, the systemd status line and readiness show of them.

Nothing here changes a worker or the pool's books; :class:`WorkerPool`'s
``status``, ``workers`` and ``readiness`` hand their books to these functions.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import msgspec

from supervisor.models.gpu_place import GpuPlacement
from supervisor.workers.gpu_room import handle_key, worker_devices
from supervisor.workers.handle import WorkerHandle, WorkerState

# A worker's key in the pool's books: (model id, embedding).
Key = tuple[str, bool]


def describe(h: WorkerHandle, placed: GpuPlacement | None = None) -> dict[str, Any]:
    expires = None
    if h.keep_alive >= 0 and h.state is WorkerState.READY:
        left = h.keep_alive - (h.clock() - h.last_used)
        expires = None if h.busy else round(time.time() + max(0.0, left), 3)
    return {
        "keep_alive_s": h.keep_alive,
        "keep_alive_expires_at": expires,
        "load_progress": h.load_progress,
        "model": h.spec.model_id,
        "mode": "embedding" if h.spec.embedding else "generate",
        "state": h.state.value,
        "pid": h.pid,
        "restarts": h.restarts,
        "restarts_by_cause": {c.value: n for c, n in h.restarts_by_cause.items()},
        "reason": h.reason,
        "queued": len(h.queue),
        "in_flight": len(h.inflight),
        "parallel": h.spec.parallel,
        "device": h.spec.device,
        "devices": worker_devices(h),
        # Where it was placed and from which numbers (free memory per GPU, headroom, split).
        "placement": None if placed is None else msgspec.to_builtins(placed),
        "n_ctx": h.facts.n_ctx if h.facts else None,
        "stats": None if h.stats is None else {
            "busy": h.stats.busy, "requests_done": h.stats.requests_done,
            "requests_cancelled": h.stats.requests_cancelled,
            "tokens_generated": h.stats.tokens_generated,
            "draft_tokens": h.stats.draft_tokens, "draft_accepted": h.stats.draft_accepted},
        "speculative": h.spec.speculative.mode,
    }


def model_status(handles: Mapping[Key, WorkerHandle], placements: Mapping[Key, GpuPlacement],
                 model_id: str) -> dict[str, Any] | None:
    """A model's worker, its generation worker first; None when none is loaded."""
    handle = handles.get((model_id, False)) or handles.get((model_id, True))
    return None if handle is None else describe(handle, placements.get(handle_key(handle)))


def worker_list(handles: Mapping[Key, WorkerHandle],
                placements: Mapping[Key, GpuPlacement]) -> list[dict[str, Any]]:
    return [describe(h, placements.get(k)) for k, h in handles.items()]


def readiness(handles: Mapping[Key, WorkerHandle]) -> dict[str, bool]:
    """Per model with a generation worker: does it serve chat and completions?

    A model's embedding worker does not make it ready: it serves only
    ``/v1/embeddings``.
    """
    return {model: h.state is WorkerState.READY
            for (model, embedding), h in handles.items() if not embedding}
