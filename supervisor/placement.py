"""Where a model fits: free memory, the memory budget, and the context choice.

The pool asks :func:`plan_load` before spawning a worker; a model whose
weights cannot fit is refused here, before any loading, with the sizes named.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from supervisor.config import ModelSettings
from supervisor.library import ModelEntry
from supervisor.memfit import ContextDecision, KvOptions, MemorySnapshot, choose_context, free_memory


async def measure_free(budget_bytes: int, committed: Iterable[int]) -> tuple[int, str]:
    """Free bytes for a new model and the memory kind (gpu or ram).

    With a budget, what loaded models were planned to use is subtracted from
    it, and the result is capped by what is really free.
    """
    snap: MemorySnapshot = await asyncio.to_thread(free_memory)
    free = snap.free_bytes
    if budget_bytes > 0:
        free = min(free, max(0, budget_bytes - sum(committed)))
    return free, snap.kind


def plan_load(entry: ModelEntry, settings: ModelSettings, *, explicit_ctx: bool, target_ctx: int,
              min_ctx: int, free_bytes: int, memory_kind: str, slots: int = 1) -> ContextDecision | None:
    """The context to load with, or None when the header is unreadable (the
    worker then fails to load it, exit code 3, and reports why).

    Raises DoesNotFit (400) when nothing fits in ``free_bytes``.
    """
    info = entry.info
    if info is None:
        return None
    cache = settings.cache_type or "f16"
    # The worker sets the engine's flash attention and swa_full to match.
    opts = KvOptions(cache_type_k=cache, cache_type_v=cache, flash_attn=cache != "f16", slots=slots)
    native = info.context_length or target_ctx
    requested = settings.n_ctx if explicit_ctx else None
    return choose_context(
        info,
        weight_bytes=entry.size_bytes,
        free_bytes=free_bytes,
        requested=requested,
        target=min(target_ctx, native) if requested is None else None,
        floor=min(min_ctx, native),
        opts=opts,
        memory_kind=memory_kind,
    )
