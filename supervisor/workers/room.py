"""Room for a model load: the count limit, the memory fit, and eviction.

``Room`` decides how a new worker fits: it stops the least recently used idle
worker while there are too many loaded or too little memory, waits (up to
``load_wait_timeout``) for a busy one to go idle, and plans the load's context
and GPU layers (supervisor/models/placement.py) against what is free. With
GPUs in the lease it places the load per GPU (supervisor/workers/gpu_room.py)
and, before stopping a worker there, tells the settle wait what comes back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

import msgspec

from supervisor.config import ModelSettings
from supervisor.errors import NotFound, Unavailable
from supervisor.models.draft import SpeculativePlan
from supervisor.models.gpu_place import GpuPlacement, cpu_placement
from supervisor.models.library import ModelEntry
from supervisor.models.memfit import ContextDecision, DoesNotFit
from supervisor.models.memory import MemorySnapshot, free_memory
from supervisor.models.placement import measure_free, plan_load
from supervisor.models.slots import SlotAsk
from supervisor.workers.gpu_room import GpuRoom
from supervisor.workers.handle import WorkerHandle, WorkerState

log = logging.getLogger("gpuvisor.pool")

Key = tuple[str, bool]  # (model, embedding)


def holds_memory(h: WorkerHandle) -> bool:
    """Whether the worker has (or is about to have) a process holding memory:
    failed and stopped ones hold none."""
    return h.state not in (WorkerState.FAILED, WorkerState.STOPPED)


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
                 drop: Callable[[Key, str], Awaitable[None]], changed: asyncio.Event, *,
                 gpus: GpuRoom | None = None, placements: dict[Key, GpuPlacement] | None = None) -> None:
        self.cfg = cfg
        self.gpus = gpus if gpus is not None and gpus.enabled() else None
        self.placements: dict[Key, GpuPlacement] = {} if placements is None else placements
        self.handles = handles
        self.fits = fits
        self.drop = drop
        self.changed = changed  # the pool's own changes (a handle added or dropped)
        # Asked before a worker starts on a node's own disk (model, node, path):
        # None when the file is there, else why not, its record there dropped
        # (supervisor/lab/node_models.py). None: nothing to ask (no cluster).
        self.check_held: Callable[[str, str, str], Awaitable[str | None]] | None = None

    async def check_fits_at_all(self, entry: ModelEntry, settings: ModelSettings,
                                explicit_ctx: bool, slots: SlotAsk, embedding: bool,
                                draft: SpeculativePlan | None = None) -> None:
        """Raise DoesNotFit (400, param n_ctx) when the load would not fit even
        in all of the memory (or the whole budget) with no model loaded: then
        no eviction or wait can help, and none is made."""
        if self.gpus is not None:
            ceiling, kind = await self.gpus.ceiling(self.cfg.memory_budget_mib << 20), "gpu"
        else:
            snap: MemorySnapshot = await asyncio.to_thread(free_memory)
            ceiling, kind = snap.total_bytes, snap.kind
            if self.cfg.memory_budget_mib > 0:
                ceiling = min(ceiling, self.cfg.memory_budget_mib << 20)
        await asyncio.to_thread(
            plan_load, entry, settings, explicit_ctx=explicit_ctx, target_ctx=self.cfg.n_ctx,
            min_ctx=self.cfg.min_ctx, free_bytes=ceiling, memory_kind=kind, slots=slots.base,
            embedding=embedding, draft=draft)

    async def fit(self, entry: ModelEntry, settings: ModelSettings,
                  explicit_ctx: bool, slots: SlotAsk, embedding: bool,
                  draft: SpeculativePlan | None = None) -> ContextDecision | None:
        return (await self.fit_placed(entry, settings, explicit_ctx, slots, embedding, draft))[0]

    async def _plan(self, entry: ModelEntry, settings: ModelSettings, explicit_ctx: bool,
                    slots: SlotAsk, embedding: bool,
                    draft: SpeculativePlan | None) -> tuple[ContextDecision | None, GpuPlacement]:
        """One look at the memory and the plan in it; DoesNotFit when it does not fit."""
        # A failed worker runs no process: what it was planned to use is free.
        committed = [f.needed_bytes for k, f in self.fits.items()
                     if f is not None and k in self.handles and holds_memory(self.handles[k])]

        def plan(free: int, kind: str) -> ContextDecision | None:
            return plan_load(entry, settings, explicit_ctx=explicit_ctx, target_ctx=self.cfg.n_ctx,
                             min_ctx=self.cfg.min_ctx, free_bytes=free, memory_kind=kind,
                             slot_ask=slots, embedding=embedding, draft=draft)

        if self.gpus is None:
            free, kind = await measure_free(self.cfg.memory_budget_mib << 20, committed)
            # In a thread: it reads the headers of a shard set's further files.
            decision = await asyncio.to_thread(plan, free, kind)
            return decision, cpu_placement() if kind == "ram" else GpuPlacement(
                mode="single", devices=["gpu"], usable_bytes=free, headroom=0.0,
                reason="all visible GPU memory as one (the lease manages no GPU by itself)")
        budget = self.cfg.memory_budget_mib << 20
        left = max(0, budget - sum(committed)) if budget > 0 else None
        readings = await self.gpus.open_readings()
        # A worker still starting has not taken its memory yet: count its plan as used.
        starting = [(self.placements[k], f.needed_bytes) for k, h in self.handles.items()
                    if h.state is WorkerState.STARTING and k in self.placements
                    and (f := self.fits.get(k)) is not None]
        readings = self.gpus.less_planned(readings, starting)
        ram = self.gpus.ram_left(starting)
        if entry.nodes:
            # On nodes' own disks: only a node that holds it can load it.
            readings = [r for r in readings if r.node in entry.nodes]
            ram = {n: free for n, free in ram.items() if n in entry.nodes}
            if not readings and not ram:
                raise Unavailable(f"model {entry.id} is held only on {', '.join(sorted(entry.nodes))} "
                                  "(its own disk), and no such node serves in the cluster now",
                                  retry_after=30, code="model_not_on_any_node")
        placed, decision = await asyncio.to_thread(
            self.gpus.place_now, readings, lambda free: plan(free, "gpu"), left,
            # A cluster's nodes without a GPU: the model in their RAM.
            lambda free: plan(free, "ram"), ram)
        return decision, placed

    async def fit_placed(self, entry: ModelEntry, settings: ModelSettings,
                         explicit_ctx: bool, slots: SlotAsk, embedding: bool,
                         draft: SpeculativePlan | None = None
                         ) -> tuple[ContextDecision | None, GpuPlacement]:
        """The fit and the devices of a new worker, evicting idle ones (and
        waiting for busy ones) while it does not fit."""
        deadline = asyncio.get_running_loop().time() + self.cfg.load_wait_timeout
        while True:
            try:
                decision, placed = await self._plan(entry, settings, explicit_ctx, slots,
                                                    embedding, draft)
                # Idle models give way before layers go to the CPU; busy ones are not waited for.
                if decision is not None and decision.partial_offload and await self.evict_lru(
                        f"evicted to make room for all layers of {entry.id}"):
                    continue
                return decision, placed
            except DoesNotFit:
                if await self.evict_lru(f"evicted to make room for {entry.id}"):
                    continue
                if not self.live() or not await self.wait_change(deadline):
                    raise
                # A busy model may go idle (then it can be evicted): try again.

    async def fit_held(self, entry: ModelEntry, settings: ModelSettings, explicit_ctx: bool, slots: SlotAsk,
                       embedding: bool, draft: SpeculativePlan | None,
                       lookup: Callable[[str], ModelEntry | None]
                       ) -> tuple[ModelEntry, ContextDecision | None, GpuPlacement]:
        """fit_placed, and for a model on nodes' own disks its file checked on
        the node placed on (``check_held``): a node that lost it is dropped
        from its records, and the model, looked up again, is placed on its
        other nodes; with none left, a 404 naming the node and the file
        rather than a worker that cannot load. The entry comes back with
        its path on the node placed on."""
        decision, placed = await self.fit_placed(entry, settings, explicit_ctx, slots, embedding, draft)
        while entry.nodes and self.check_held is not None:
            missing = await self.check_held(entry.id, placed.node, entry.nodes[placed.node])
            if missing is None:
                break
            again = lookup(entry.id)
            if again is None or not again.usable:
                # Still held on nodes that are not serving: why it cannot go there.
                why = f"; {again.reason}" if again is not None and again.nodes and again.reason else ""
                raise NotFound(missing + why, code="model_file_missing")
            entry = again
            decision, placed = await self.fit_placed(entry, settings, explicit_ctx, slots, embedding, draft)
        if entry.nodes:
            # Placed only where it is held (_plan): its path on that node.
            path = entry.nodes[placed.node]
            entry = msgspec.structs.replace(entry, path=path, files=[path], mmproj=entry.node_mmproj.get(placed.node))
        return entry, decision, placed

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
        return [h for h in self.handles.values() if holds_memory(h)]

    async def evict_lru(self, reason: str) -> bool:
        """Stop the least recently used idle worker; False when none is idle.

        A failed model is never taken: it frees nothing (its process is gone),
        and dropping it would drop its failed state, so the next request
        would load it again instead of being told it failed.
        """
        idle = [(h.last_used, key) for key, h in self.handles.items()
                if not h.busy and holds_memory(h) and h.state is not WorkerState.STARTING]
        if not idle:
            return False
        _, key = min(idle)
        log.info("%s: stopping idle %s", reason, key[0])
        placed, fit = self.placements.get(key), self.fits.get(key)
        if self.gpus is not None and placed is not None and fit is not None:
            await self.gpus.expect_freed([(placed, fit.needed_bytes)])
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
