"""How adapters appear in ``/v1/models`` (one model id per base and adapter)
and in ``/api/models`` (each adapter with its candidate bases, fitting or not)."""

from __future__ import annotations

from typing import Any

from supervisor.models.adapters import AdapterEntry, pair_id
from supervisor.models.library import ModelEntry
from supervisor.workers.pool import WorkerPool


def _state(pool: WorkerPool, base: str, fits: bool) -> tuple[str, str | None]:
    status = pool.status(base)
    if not fits:
        return "unusable", None
    return (status["state"], status["reason"]) if status else ("unloaded", None)


def v1_pairs(pool: WorkerPool) -> list[dict[str, Any]]:
    """The ``/v1/models`` items of every adapter linked to a base, refused ones with the reason."""
    out = []
    for adapter in pool.models.adapters():
        for link in adapter.links:
            state, reason = _state(pool, link.base, link.fits)
            out.append({"id": link.id, "object": "model", "created": int(adapter.mtime),
                        "owned_by": "gpuvisor", "state": state, "reason": link.reason or reason,
                        "parent": link.base, "adapter": adapter.id})
    return sorted(out, key=lambda m: m["id"])


def describe_adapter(adapter: AdapterEntry) -> dict[str, Any]:
    info = adapter.info
    return {
        "id": adapter.id,
        "object": "adapter",
        "path": adapter.path,
        "size_bytes": adapter.size_bytes,
        "architecture": info.architecture if info else None,
        "base_name": info.base_name if info else None,
        "rank": info.rank if info else None,
        "alpha": info.alpha if info else None,
        "usable": adapter.usable,
        "reason": adapter.reason,
        "links": [{"base": lk.base, "model": lk.id, "fits": lk.fits, "reason": lk.reason}
                  for lk in adapter.links],
    }


def api_adapters(pool: WorkerPool) -> list[dict[str, Any]]:
    return [describe_adapter(a) for a in sorted(pool.models.adapters(), key=lambda a: a.id)]


def base_adapters(entry: ModelEntry) -> list[dict[str, Any]]:
    """The adapters that fit a base, as ``/api/models`` shows them under it
    (the refused ones are in the list's ``adapters``, with the reason)."""
    return [{"adapter": a.id, "model": pair_id(entry.id, a.id), "size_bytes": a.size_bytes}
            for a in entry.adapters]
