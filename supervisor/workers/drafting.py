"""What the pool knows of each model's speculative decoding: the plan its
worker runs with, the last refusal (shown in ``/api/models``), and the
acceptance counters its worker reports."""

from __future__ import annotations

from typing import Any

from supervisor.models.draft import SpeculativePlan
from supervisor.workers.handle import WorkerHandle, WorkerState


class SpeculativeBook:
    """Per model id: the plan of its generation worker and why a load was refused."""

    def __init__(self) -> None:
        self.plans: dict[str, SpeculativePlan] = {}
        self.refusals: dict[str, str] = {}

    def planned(self, model_id: str, plan: SpeculativePlan) -> None:
        self.plans[model_id] = plan
        self.refusals.pop(model_id, None)

    def refused(self, model_id: str, reason: str) -> None:
        self.refusals[model_id] = reason


def acceptance(drafted: int, accepted: int) -> float | None:
    """Share of drafted tokens the target kept; None before anything was drafted."""
    return None if drafted <= 0 else accepted / drafted


def describe_speculative(book: SpeculativeBook, model_id: str, handle: WorkerHandle | None) -> dict[str, Any]:
    """The ``speculative`` object of a model in ``/api/models``.

    ``mode`` is the drafting in effect in a started worker (``auto``
    resolved), null while none runs; the counters are the worker's since it
    started; ``error`` is why the last load with these settings was refused."""
    running = handle is not None and handle.state not in (WorkerState.FAILED, WorkerState.STOPPED)
    plan = book.plans.get(model_id) if running else None
    stats = handle.stats if running and handle is not None else None
    opts = handle.spec.speculative if running and handle is not None else None
    drafted = stats.draft_tokens if stats is not None else 0
    accepted = stats.draft_accepted if stats is not None else 0
    return {
        "mode": opts.mode if opts is not None else None,
        "draft_model": plan.draft_id if plan is not None else None,
        "draft_min": (opts.draft_min or None) if opts is not None else None,
        "draft_max": (opts.draft_max or None) if opts is not None else None,
        "draft_tokens": drafted if stats is not None else None,
        "draft_accepted": accepted if stats is not None else None,
        "acceptance_rate": acceptance(drafted, accepted),
        "error": book.refusals.get(model_id),
    }
