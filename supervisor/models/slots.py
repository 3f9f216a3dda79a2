"""How many engine slots a worker runs, when ``parallel`` is automatic.

Each slot holds a KV cache of the whole per-request context, so slots cost
memory that the context could have had. The load is planned first with a
base count (2 on the CPU, 4 on a GPU) and its context; then slots are added,
at that context, while the load still fits in its own memory plus half of
what it leaves free, up to a cap (8 on the CPU, 16 on a GPU). Half: the
other half stays free for the next model and for the OS.

Why more than the base: the engine batches its slots into one step, so an
idle slot costs its cache and nothing else, and a short request need not
wait behind long ones (measured on the CPU: a 5-token request took 14.9 s
behind 7 long streams with 2 slots and 0.96 s with 8, at the same total
tokens per second). The caps are round figures, not measurements: past
them a busy machine's streams would only share the same throughput more
thinly, and each slot still holds a whole context of memory.

A split model (partial offload) gets no more than the base: its GPU memory
went to layers. An embedding worker keeps the base too: its slots share one
cache and batch inputs, where more slots would not shorten a wait.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import msgspec

from supervisor.config import (
    AUTO_PARALLEL_MAX_CPU,
    AUTO_PARALLEL_MAX_GPU,
    DEFAULT_PARALLEL_CPU,
    DEFAULT_PARALLEL_GPU,
    ModelSettings,
)
from supervisor.models.memfit import ContextDecision, DoesNotFit, gib

MIB = 1 << 20


class SlotAsk(NamedTuple):
    """The slots planned first and the most an automatic count grows to."""

    base: int
    most: int
    explicit: bool = False


def slot_ask(settings: ModelSettings, device: str, *, embedding: bool = False) -> SlotAsk:
    """The setting as it is, or automatic: from the device's base to its cap."""
    if settings.parallel:
        return SlotAsk(settings.parallel, settings.parallel, explicit=True)
    on_cpu = device == "cpu"
    base = DEFAULT_PARALLEL_CPU if on_cpu else DEFAULT_PARALLEL_GPU
    return SlotAsk(base, base if embedding else AUTO_PARALLEL_MAX_CPU if on_cpu else AUTO_PARALLEL_MAX_GPU)


def size(n: int) -> str:
    """Bytes in GiB, or MiB below one (a small model's slot is a few MiB)."""
    return gib(n) if n >= 1 << 30 else f"{n / MIB:.1f} MiB"


# (slots, n_ctx) -> the plan of that many slots at that explicit context.
PlanAt = Callable[[int, int], ContextDecision | None]


def with_slots(decision: ContextDecision, ask: SlotAsk, plan_at: PlanAt) -> ContextDecision:
    """``decision`` (planned with ``ask.base`` slots) with the slots the
    worker runs, grown where ``ask`` is automatic, and the reason."""
    if ask.explicit:
        return msgspec.structs.replace(decision, slots_reason=f"parallel {ask.base}, as set")
    if ask.most <= ask.base:
        return msgspec.structs.replace(decision, slots_reason=(
            f"automatic: {ask.base}, the base count (an embedding worker batches its inputs instead)"))
    if decision.partial_offload:
        return msgspec.structs.replace(decision, slots_reason=(
            f"automatic: {ask.base}; the model is split between GPU and RAM, so no memory is spare for more"))
    spare = max(0, decision.free_bytes - decision.needed_bytes)
    allowed = decision.needed_bytes + spare // 2
    best, stop = decision, ", the automatic cap (parallel sets more)"
    for slots in range(ask.base + 1, ask.most + 1):
        try:
            more = plan_at(slots, decision.n_ctx)
        except DoesNotFit:
            more = None  # this many do not fit: the count before it stands
        if more is None or more.partial_offload:
            stop = f"; {slots} do not fit"
            break
        if more.needed_bytes > allowed:
            stop = (f"; {slots} would need {size(more.needed_bytes - decision.needed_bytes)} more,"
                    f" over half of the {size(spare)} left free")
            break
        best = more
    n = best.slots
    why = (f"automatic: {n} slots of context {decision.n_ctx}"
           f" (KV cache {size(best.kv_bytes // max(1, n))} each){stop}")
    return msgspec.structs.replace(
        decision, kv_bytes=best.kv_bytes, compute_bytes=best.compute_bytes, reserve_bytes=best.reserve_bytes,
        needed_bytes=best.needed_bytes, host_bytes=best.host_bytes, slots=n, slots_reason=why)
