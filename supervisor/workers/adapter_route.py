"""Requests to ``<base>:<adapter>`` model ids: which worker, which adapter, what scale.

A pair runs on its base model's worker, which loads every adapter that fits
the base when it starts (the engine loads adapters only then) and applies
the one a request names. The base is never reloaded for a request whose
adapter its worker holds. An adapter that appeared after the worker started
is added by restarting that worker once it is idle; while it is busy such
a request is answered 503 with Retry-After, and the others run on.

One adapter the engine refuses costs itself alone: the worker holds the
others and names the refused one with why (``refused_adapters`` in its
facts); a request to it is a 400 ``adapter_unusable`` with that reason. The
worker restarts (when idle) only once the base's adapters are no longer the
ones it started with: an adapter added, removed or changed on disk, so a
fixed file is tried again without an unload, and the same refused set is
never tried twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from supervisor.errors import BadRequest, Unavailable
from supervisor.models.adapters import AdapterEntry, AdapterLink, AdapterRef
from supervisor.workers.handle import WorkerHandle, WorkerState

# Bounds on a request's ``lora_scale``: 0 runs the base alone, 1 the adapter
# as trained; above that it is amplified.
LORA_SCALE_MIN = 0.0
LORA_SCALE_MAX = 4.0


class _Pairs(Protocol):
    def pair(self, model_id: str) -> tuple[AdapterLink, AdapterEntry] | None: ...


@dataclass(frozen=True)
class Route:
    model: str  # the model whose worker runs the request
    adapter: str = ""  # the adapter's path, "" = none
    scale: float = 1.0


def check_scale(scale: float | None) -> None:
    if scale is not None and not LORA_SCALE_MIN <= scale <= LORA_SCALE_MAX:
        raise BadRequest(f"lora_scale must be within [{LORA_SCALE_MIN}, {LORA_SCALE_MAX}]",
                         param="lora_scale")


def plan(models: _Pairs, model_id: str, scale: float | None) -> Route:
    """Where a request for ``model_id`` runs; refuses a pair that does not fit."""
    check_scale(scale)
    # Every pair id has a colon; a plain model id skips the lookup.
    found = models.pair(model_id) if ":" in model_id else None
    if found is None:
        if scale is not None:
            raise BadRequest(f"lora_scale applies to adapter models (<base>:<adapter>), not {model_id}",
                             param="lora_scale")
        return Route(model_id)
    link, adapter = found
    if adapter.fault is not None:
        raise BadRequest(f"adapter {adapter.id} is unusable: {adapter.fault}",
                         param="model", code="adapter_unusable")
    if not link.fits:
        raise BadRequest(f"adapter {adapter.id} does not fit {link.base}: {link.reason}",
                         param="model", code="adapter_mismatch")
    return Route(link.base, adapter.path, 1.0 if scale is None else scale)


def _versions(handle: WorkerHandle) -> dict[str, tuple[int, float]]:
    """Each adapter the worker was started with, and the version of its file then."""
    return {str(p): v for p, v in zip(handle.spec.lora, handle.spec.lora_versions, strict=False)}


def refusal(handle: WorkerHandle | None, adapter: str, version: tuple[int, float]) -> str | None:
    """Why the base's running worker does not hold ``adapter`` though it was
    given it; None if it holds it, or the file (``version``: size, mtime) changed since."""
    facts = handle.facts if handle is not None else None
    if facts is None or handle is None or _versions(handle).get(adapter) != version:
        return None
    return facts.refused_adapters.get(adapter)


def needs_restart(route: Route, handle: WorkerHandle | None, adapters: list[AdapterRef]) -> bool:
    """Whether the base's running worker lacks the adapter and should be
    restarted (when idle) to load ``adapters``, the ones that fit it now;
    busy: 503. Raises ``adapter_unusable`` for one its worker refused and
    that is unchanged since. A failed base is not restarted by a request: it
    stays failed until loaded."""
    if not route.adapter or handle is None or handle.state is WorkerState.FAILED:
        return False
    started = _versions(handle)
    now = {a.path: (a.size_bytes, a.mtime) for a in adapters}
    if started == now:
        # Nothing changed since it started: a restart would load the same set.
        facts = handle.facts
        # While it loads, what it was given (the worker answers); once loaded, what it holds.
        if facts is None or route.adapter in facts.adapters:
            return False
        why = facts.refused_adapters.get(route.adapter) or "it does not hold it"
        raise BadRequest(f"adapter {Path(route.adapter).stem} is unusable: the worker of {route.model} "
                         f"refused it: {why}", param="model", code="adapter_unusable")
    held = route.adapter in (handle.facts.adapters if handle.facts is not None else started)
    if held and started.get(route.adapter) == now.get(route.adapter):
        return False  # others changed: this one is served as it is
    if handle.busy:
        raise Unavailable(f"the worker of {route.model} is busy; it restarts to load adapter "
                          f"{Path(route.adapter).stem} once idle", retry_after=2, code="adapter_loading")
    return True
