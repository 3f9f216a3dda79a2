"""Room for a model load: the count limit, the memory fit, and eviction.

``Room`` decides how a new worker fits: it stops the least recently used idle
worker while there are too many loaded or too little memory, waits (up to
``load_wait_timeout``) for a busy one to go idle, and plans the load's context
and GPU layers (supervisor/models/placement.py) against what is free.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from supervisor.config import ModelSettings
from supervisor.errors import Unavailable
from supervisor.models.library import ModelEntry
from supervisor.models.memfit import ContextDecision, DoesNotFit
from supervisor.models.memory import MemorySnapshot, free_memory
from supervisor.models.placement import measure_free, plan_load
from supervisor.workers.handle import WorkerHandle, WorkerState

log = logging.getLogger("gpuvisor.pool")

Key = tuple[str, bool]  # (model, embedding)


class RoomConfig(Protocol):
    n_ctx: int
    max_loaded_models: int
    min_ctx: int
    memory_budget_mib: int
    load_wait_timeout: float


class Room:
    """Reads and evicts from the pool's handles and fits; ``drop`` stops one."""

    def __init__(self, cfg: RoomConfig, handles: dict[Key, WorkerHandle],
                 fits: dict[Key, ContextDecision | None],
                 drop: Callable[[Key, str], Awaitable[None]], changed: asyncio.Event) -> None:
        self.cfg = cfg
        self.handles = handles
        self.fits = fits
        self.drop = drop
        self.changed = changed  # the pool's own changes (a handle added or dropped)

    async def check_fits_at_all(self, entry: ModelEntry, settings: ModelSettings,
                                explicit_ctx: bool, parallel: int, embedding: bool) -> None:
        """Raise DoesNotFit (400, param n_ctx) when the load would not fit even
        in all of the memory (or the whole budget) with no model loaded: then
        no eviction or wait can help, and none is made."""
        snap: MemorySnapshot = await asyncio.to_thread(free_memory)
        ceiling = snap.total_bytes
        if self.cfg.memory_budget_mib > 0:
            ceiling = min(ceiling, self.cfg.memory_budget_mib << 20)
        await asyncio.to_thread(
            plan_load, entry, settings, explicit_ctx=explicit_ctx, target_ctx=self.cfg.n_ctx,
            min_ctx=self.cfg.min_ctx, free_bytes=ceiling, memory_kind=snap.kind, slots=parallel,
            embedding=embedding)

    async def fit(self, entry: ModelEntry, settings: ModelSettings,
                  explicit_ctx: bool, parallel: int, embedding: bool) -> ContextDecision | None:
        deadline = asyncio.get_running_loop().time() + self.cfg.load_wait_timeout
        while True:
            committed = [f.needed_bytes for f in self.fits.values() if f is not None]
            free, kind = await measure_free(self.cfg.memory_budget_mib << 20, committed)
            try:
                # In a thread: it reads the headers of a shard set's further files.
                decision = await asyncio.to_thread(
                    plan_load, entry, settings, explicit_ctx=explicit_ctx, target_ctx=self.cfg.n_ctx,
                    min_ctx=self.cfg.min_ctx, free_bytes=free, memory_kind=kind, slots=parallel,
                    embedding=embedding)
                # Idle models give way before layers go to the CPU; busy ones are not waited for.
                if decision is not None and decision.partial_offload and await self.evict_lru(
                        f"evicted to make room for all layers of {entry.id}"):
                    continue
                return decision
            except DoesNotFit:
                if await self.evict_lru(f"evicted to make room for {entry.id}"):
                    continue
                if not self.live() or not await self.wait_change(deadline):
                    raise
                # A busy model may go idle (then it can be evicted): try again.

    async def make_room_by_count(self, model_id: str) -> None:
        deadline = asyncio.get_running_loop().time() + self.cfg.load_wait_timeout
        while len(self.live()) >= self.cfg.max_loaded_models:
            if await self.evict_lru(f"evicted to make room for {model_id}"):
                continue
            if not await self.wait_change(deadline):
                raise Unavailable(
                    f"all {self.cfg.max_loaded_models} loaded models are busy; "
                    f"'{model_id}' cannot be loaded now", retry_after=5, code="no_capacity")

    def live(self) -> list[WorkerHandle]:
        # Failed and stopped handles hold no process and no memory.
        return [h for h in self.handles.values()
                if h.state not in (WorkerState.FAILED, WorkerState.STOPPED)]

    async def evict_lru(self, reason: str) -> bool:
        """Stop the least recently used idle worker; False when none is idle."""
        idle = [(h.last_used, key) for key, h in self.handles.items()
                if not h.busy and h.state is not WorkerState.STARTING]
        if not idle:
            return False
        _, key = min(idle)
        log.info("%s: stopping idle %s", reason, key[0])
        await self.drop(key, reason)
        return True

    async def wait_change(self, deadline: float) -> bool:
        """Wait for any handle to change state; False once the deadline passed."""
        loop = asyncio.get_running_loop()
        remaining = deadline - loop.time()
        if remaining <= 0:
            return False
        waiters = [asyncio.ensure_future(h.changed.wait()) for h in self.handles.values()]
        waiters.append(asyncio.ensure_future(self.changed.wait()))
        for h in self.handles.values():
            h.changed.clear()
        self.changed.clear()
        try:
            await asyncio.wait(waiters, timeout=min(remaining, 1.0), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()
        return True
