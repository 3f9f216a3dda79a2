"""Requests to ``<base>:<adapter>`` model ids: which worker, which adapter, what scale.

A pair runs on its base model's worker, which loads every adapter that fits
the base when it starts (the engine loads adapters only then) and applies
the one a request names. The base is never reloaded for a request whose
adapter its worker holds. An adapter that appeared after the worker started
is added by restarting that worker once it is idle; while it is busy such
a request is answered 503 with Retry-After, and the others run on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from supervisor.errors import BadRequest, Unavailable
from supervisor.models.adapters import AdapterEntry, AdapterLink
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
    if not link.fits:
        raise BadRequest(f"adapter {adapter.id} does not fit {link.base}: {link.reason}",
                         param="model", code="adapter_mismatch")
    return Route(link.base, adapter.path, 1.0 if scale is None else scale)


def needs_restart(route: Route, handle: WorkerHandle | None) -> bool:
    """Whether the base's running worker lacks the adapter (then it is restarted
    when idle, which loads every adapter that fits it now); busy: 503. A
    failed base is not restarted by a request: it stays failed until loaded."""
    if not route.adapter or handle is None or Path(route.adapter) in handle.spec.lora:
        return False
    if handle.state is WorkerState.FAILED:
        return False
    if handle.busy:
        raise Unavailable(f"the worker of {route.model} is busy; it restarts to load adapter "
                          f"{Path(route.adapter).stem} once idle", retry_after=2, code="adapter_loading")
    return True
