"""How adapters appear in ``/v1/models`` (one model id per base and adapter)
and in ``/api/models`` (each adapter with its candidate bases, fitting or not).

``adapter_error`` says why an adapter that fits is not served: its file's
own fault, or the refusal of the base's running worker (worker/adapters.py);
null when nothing stands in its way.
"""

from __future__ import annotations

from typing import Any

from supervisor.models.adapters import AdapterEntry, AdapterLink, pair_id
from supervisor.models.library import ModelEntry
from supervisor.workers.adapter_route import refusal
from supervisor.workers.pool import WorkerPool


def _refused(pool: WorkerPool, adapter: AdapterEntry, link: AdapterLink) -> str | None:
    """Why the running worker of ``link.base`` does not hold ``adapter``, if it refused it."""
    why = refusal(pool.handles.get((link.base, False)), adapter.path, (adapter.size_bytes, adapter.mtime))
    return None if why is None else f"the worker of {link.base} refused it: {why}"


def adapter_error(pool: WorkerPool, adapter: AdapterEntry) -> str | None:
    """The file's fault, else the first refusal by a base's worker; None when served."""
    if adapter.fault is not None:
        return adapter.fault
    return next((why for lk in adapter.links if lk.fits and (why := _refused(pool, adapter, lk))), None)


def _state(pool: WorkerPool, adapter: AdapterEntry, link: AdapterLink) -> tuple[str, str | None]:
    if not link.fits:
        return "unusable", link.reason
    refused = _refused(pool, adapter, link)
    if refused is not None:
        return "unusable", refused
    status = pool.status(link.base)
    return (status["state"], status["reason"]) if status else ("unloaded", None)


def v1_pairs(pool: WorkerPool) -> list[dict[str, Any]]:
    """The ``/v1/models`` items of every adapter linked to a base, refused ones with the reason."""
    out = []
    for adapter in pool.models.adapters():
        for link in adapter.links:
            state, reason = _state(pool, adapter, link)
            error = adapter.fault if adapter.fault is not None else (
                _refused(pool, adapter, link) if link.fits else None)
            out.append({"id": link.id, "object": "model", "created": int(adapter.mtime),
                        "owned_by": "gpuvisor", "state": state, "reason": reason,
                        "parent": link.base, "adapter": adapter.id, "adapter_error": error})
    return sorted(out, key=lambda m: m["id"])


def describe_adapter(adapter: AdapterEntry, error: str | None = None) -> dict[str, Any]:
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
        "adapter_error": error if error is not None else adapter.fault,
        "links": [{"base": lk.base, "model": lk.id, "fits": lk.fits, "reason": lk.reason}
                  for lk in adapter.links],
    }


def api_adapters(pool: WorkerPool) -> list[dict[str, Any]]:
    return [describe_adapter(a, adapter_error(pool, a)) for a in sorted(pool.models.adapters(), key=lambda a: a.id)]


def base_adapters(entry: ModelEntry) -> list[dict[str, Any]]:
    """The adapters that fit a base, as ``/api/models`` shows them under it
    (the refused ones are in the list's ``adapters``, with the reason)."""
    return [{"adapter": a.id, "model": pair_id(entry.id, a.id), "size_bytes": a.size_bytes}
            for a in entry.adapters]
