"""The worker pool: one WorkerHandle per (model, mode), and the request API.

Route handlers call :meth:`WorkerPool.admit` / ``embed`` / ``tokenize``;
worker-side failures come back as typed :mod:`supervisor.errors` exceptions.
The pool decides nothing about the GPU by itself: before admitting a request
it asks the lease (``admission``) whether model workers may run on the
worker's devices; a new worker is placed on the GPUs no job holds
(supervisor/workers/gpu_room.py) and booked on them in the lease.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import msgspec

from supervisor.config import (
    DEFAULT_PARALLEL_CPU,
    DEFAULT_PARALLEL_GPU,
    ModelSettings,
    parse_duration,
)
from supervisor.errors import (
    ApiError,
    BadRequest,
    DeviceBusy,
    ModelFailed,
    ModelNotFound,
    Unavailable,
)
from supervisor.models.draft import SpeculativePlan, plan_speculative
from supervisor.models.gpu_place import GpuPlacement
from supervisor.models.library import ModelEntry
from supervisor.models.memfit import ContextDecision
from supervisor.models.placement import FALLBACK_CTX
from supervisor.models.source import LibrarySource
from supervisor.workers import adapter_route
from supervisor.workers.drafting import SpeculativeBook
from supervisor.workers.gpu_room import (
    Bookings,
    GpuRoom,
    booking_key,
    handle_key,
    worker_devices,
)
from supervisor.workers.handle import NotAccepting, WorkerHandle, WorkerState
from supervisor.workers.poison import PoisonTracker, fingerprint
from supervisor.workers.queue import Pending, QueueFull, WorkerGone
from supervisor.workers.replies import Generation, as_api_error
from supervisor.workers.room import Room
from supervisor.workers.spec import Timing, WorkerSpec
from worker import protocol as p

# Generation: the routes stream an admitted completion through it.
__all__ = ["Generation", "PoolConfig", "WorkerPool", "describe"]

log = logging.getLogger("gpuvisor.pool")


Admission = Callable[[str], str | None]


class PoolConfig(Protocol):
    n_ctx: int
    n_threads: int
    queue_limit: int
    max_loaded_models: int
    min_ctx: int
    memory_budget_mib: int
    load_wait_timeout: float
    model_defaults: dict[str, ModelSettings]

    def model_settings(self, model_id: str) -> ModelSettings: ...


# Inputs per Embed message to a worker.
EMBED_BATCH = 32


def _no_lease(_device: str) -> str | None:
    return None


class WorkerPool:
    def __init__(self, models: LibrarySource, cfg: PoolConfig, timing: Timing,
                 run_dir: Path, log_dir: Path, admission: Admission = _no_lease,
                 device: str = "cpu", reap_interval: float = 0.25,
                 clock: Callable[[], float] | None = None, *, gpus: GpuRoom | None = None,
                 bookings: Bookings | None = None) -> None:
        self.models = models
        self.cfg = cfg
        self.timing = timing
        self.run_dir = run_dir
        self.log_dir = log_dir
        self.admission = admission
        self.device = device
        self.reap_interval = reap_interval
        self._clock = clock
        self.handles: dict[tuple[str, bool], WorkerHandle] = {}
        self.fits: dict[tuple[str, bool], ContextDecision | None] = {}
        self._lock = asyncio.Lock()
        self._changed = asyncio.Event()
        self._reaper: asyncio.Task[None] | None = None
        # Where each worker was placed, and why (shown in /api/models).
        self.placements: dict[tuple[str, bool], GpuPlacement] = {}
        self.bookings = bookings
        self.room = Room(cfg, self.handles, self.fits, self._drop, self._changed, gpus=gpus,
                         placements=self.placements)
        # Observers of finished generations (metrics): called with (model, Done).
        self.on_done: list[Callable[[str, p.Done], None]] = []
        # Requests in flight during worker crashes (supervisor/workers/poison.py).
        self.poison = PoisonTracker()
        # Each model's drafting plan and last refusal (supervisor/workers/drafting.py).
        self.speculative = SpeculativeBook()

    def start(self) -> None:
        self._reaper = asyncio.create_task(self._reap_idle(), name="keep-alive")

    # ------------------------------------------------------------ loading

    async def load(self, model_id: str, embedding: bool = False,
                   options: ModelSettings | None = None) -> WorkerHandle:
        """The handle for a model, starting its worker if needed.

        ``options`` come from an explicit load (``POST /api/models/{id}/load``):
        the same settings as the running worker are a no-op, different ones
        reload it, and a failed model is started afresh. Request-driven loads
        pass none and reuse whatever is loaded.
        """
        key = (model_id, embedding)
        self._check_admission(self.handles.get(key))
        handle = self.handles.get(key)
        if options is None and handle is not None:
            return handle
        async with self._lock:
            handle = self.handles.get(key)
            settings = (options or ModelSettings()).over(self.cfg.model_settings(model_id))
            if handle is not None and options is None:
                return handle
            entry = self.models.entry(model_id)
            if entry is None:
                raise ModelNotFound(f"model '{model_id}' does not exist", param="model")
            plan = await self._plan_speculative(entry, settings, embedding)
            if handle is not None and handle.state is not WorkerState.FAILED and self._unchanged(
                    handle, entry, options, settings) and handle.spec.speculative == plan.options:
                handle.keep_alive = parse_duration(settings.keep_alive or 0)
                return handle
            # A context set for this model in the config is as explicit as one in a load body.
            own = self.cfg.model_defaults.get(model_id)
            explicit_ctx = bool(options and options.n_ctx) or (own is not None and own.n_ctx is not None)
            # Before anything is stopped for it: a load that can never fit evicts nothing.
            await self.room.check_fits_at_all(entry, settings, explicit_ctx, self._parallel(settings), embedding,
                                              draft=plan)
            if handle is not None:
                await self._drop(key, f"model {model_id} is being reloaded with new settings")
            return await self._start_handle(key, entry, settings, explicit_ctx, plan)

    async def _plan_speculative(self, entry: ModelEntry, settings: ModelSettings,
                                embedding: bool) -> SpeculativePlan:
        """The drafting the worker runs with; a refusal (400/404 naming the
        setting) is kept for ``/api/models``."""
        try:
            # In a thread: it reads both models' tokenizer headers.
            plan = await asyncio.to_thread(plan_speculative, entry, settings, self.models, embedding)
        except ApiError as exc:
            self.speculative.refused(entry.id, exc.message)
            raise
        if not embedding:
            self.speculative.planned(entry.id, plan)
        return plan

    def _unchanged(self, handle: WorkerHandle, entry: ModelEntry, options: ModelSettings | None,
                   settings: ModelSettings) -> bool:
        if options is None:
            return True
        s = handle.spec
        want_ctx = options.n_ctx if options.n_ctx is not None else s.n_ctx
        want = (Path(entry.path), want_ctx, settings.n_gpu_layers, settings.cache_type,
                self._parallel(settings))
        # Partial offload runs fewer GPU layers than were asked for: compare what was asked.
        fit = self.fits.get((s.model_id, s.embedding))
        asked = fit.n_gpu_layers_asked if fit is not None else s.n_gpu_layers
        return want == (s.path, s.n_ctx, asked, s.cache_type, s.parallel)

    def _parallel(self, settings: ModelSettings) -> int:
        if settings.parallel:
            return settings.parallel
        # More slots than cores only slow each stream down on the CPU.
        return DEFAULT_PARALLEL_CPU if self.device == "cpu" else DEFAULT_PARALLEL_GPU

    async def _start_handle(self, key: tuple[str, bool], entry: ModelEntry, settings: ModelSettings,
                            explicit_ctx: bool, plan: SpeculativePlan | None = None) -> WorkerHandle:
        model_id, embedding = key
        parallel = self._parallel(settings)
        await self.room.make_room_by_count(model_id)
        plan = plan or SpeculativePlan()
        decision, placed = await self.room.fit_placed(entry, settings, explicit_ctx, parallel, embedding,
                                                      draft=plan)
        n_ctx = decision.n_ctx if decision is not None else (settings.n_ctx or self.cfg.n_ctx or FALLBACK_CTX)
        gpu_layers = settings.n_gpu_layers if settings.n_gpu_layers is not None else -1
        if decision is not None:
            gpu_layers = decision.n_gpu_layers  # fewer than asked with partial offload
        pinned = self.room.gpus is not None  # per-GPU devices: pin the worker to its own
        spec = WorkerSpec(model_id, Path(entry.path), embedding, n_ctx, gpu_layers,
                          self.cfg.n_threads, placed.devices[0] if pinned else self.device,
                          settings.cache_type or "f16",
                          plan.options, parallel,
                          # An embedding worker never takes images.
                          mmproj=Path(entry.mmproj) if entry.mmproj and not embedding else None,
                          lora=() if embedding else tuple(Path(a.path) for a in entry.adapters),
                          devices=tuple(placed.devices) if pinned else (self.device,),
                          gpu_indices=tuple(placed.indices) if pinned else None,
                          tensor_split=tuple(placed.tensor_split))
        handle = WorkerHandle(spec, self.timing, self.run_dir, self.log_dir, self.cfg.queue_limit, self._clock)
        handle.keep_alive = parse_duration(settings.keep_alive or 0)
        handle.crash_counts = lambda in_flight: self.poison.crashed(
            fingerprint(model_id, pend.msg) for pend in in_flight)
        self.handles[key] = handle
        self.fits[key] = decision
        self.placements[key] = placed
        if self.bookings is not None:
            self.bookings.book_worker(booking_key(key), spec.devices)
        handle.start()
        self._signal()
        return handle

    def _forget(self, key: tuple[str, bool]) -> WorkerHandle | None:
        """Take a worker out of the pool's books (and the lease's)."""
        self.fits.pop(key, None)
        self.placements.pop(key, None)
        if self.bookings is not None:
            self.bookings.unbook_worker(booking_key(key))
        return self.handles.pop(key, None)

    async def _drop(self, key: tuple[str, bool], reason: str) -> None:
        handle = self._forget(key)
        if handle is not None:
            await handle.stop(reason, "evicted")
        self._signal()

    def _signal(self) -> None:
        self._changed.set()

    async def _reap_idle(self) -> None:
        while True:
            await asyncio.sleep(self.reap_interval)
            await self.reap_once(self.now())

    async def reap_once(self, now: float) -> list[str]:
        """Unload workers idle for longer than their keep-alive at ``now``; the models unloaded."""
        unloaded = []
        for key, h in list(self.handles.items()):
            if h.busy or h.keep_alive < 0 or h.state is not WorkerState.READY:
                continue
            if now - h.last_used >= h.keep_alive:
                log.info("unloading %s: idle for %.0fs (keep-alive)", key[0], now - h.last_used)
                await self._drop(key, "keep-alive expired")
                unloaded.append(key[0])
        return unloaded

    def now(self) -> float:
        """The pool's clock, which its handles share (the event loop's unless one was given)."""
        return self._clock() if self._clock is not None else asyncio.get_running_loop().time()

    async def unload(self, model_id: str) -> bool:
        keys = [k for k in self.handles if k[0] == model_id]
        for key in keys:
            await self._drop(key, f"model {model_id} was unloaded")
        return bool(keys)

    async def stop_all(self, reason: str = "the service is shutting down") -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
        handles = list(self.handles.values())
        for key in list(self.handles):
            self._forget(key)
        await asyncio.gather(*(h.stop(reason) for h in handles))

    async def vacate(self, device: str, drain_timeout: float, reason: str) -> None:
        """GPU lease hook: idle workers go now, busy ones drain, all are stopped."""
        victims = [(k, h) for k, h in self.handles.items() if device in worker_devices(h)]
        freed = [(self.placements[k], fit.needed_bytes) for k, _ in victims
                 if k in self.placements and (fit := self.fits.get(k)) is not None]
        if self.room.gpus is not None and freed:
            # Read before they stop: the job's lease waits for this memory.
            await self.room.gpus.expect_freed(freed)
        for key, _ in victims:
            self._forget(key)
        await asyncio.gather(*(
            h.drain(drain_timeout if h.busy else 0.0, reason, "evicted") for _, h in victims))

    def _check_admission(self, handle: WorkerHandle | None) -> None:
        """503 naming the holder when a job holds (or frees) a device of the
        worker; for a worker not placed yet, when every device is taken."""
        devices = worker_devices(handle) if handle is not None else (
            self.room.gpus.gpu_devices() if self.room.gpus is not None else [self.device])
        refused = [why for why in map(self.admission, devices) if why is not None]
        if refused and (handle is not None or len(refused) == len(devices)):
            raise DeviceBusy(refused[0])

    # ------------------------------------------------------------ requests

    def _submit(self, handle: WorkerHandle, msg: p.Generate | p.Embed | p.Tokenize) -> Pending:
        self._check_admission(handle)
        # No fingerprint is taken (a hash of the whole prompt) until a crash was seen.
        if self.poison and self.poison.is_poison(fingerprint(handle.spec.model_id, msg)):
            raise BadRequest(
                f"this request crashed the model worker of '{handle.spec.model_id}' twice; "
                "it is refused so that it cannot take the model down for others", code="request_crashed_worker")
        try:
            return handle.submit(msg)
        except QueueFull as exc:
            raise Unavailable(str(exc), retry_after=2, code="queue_full") from exc
        except NotAccepting as exc:
            if exc.state is WorkerState.FAILED:
                raise ModelFailed(f"model '{handle.spec.model_id}' failed: {exc.reason}; "
                                  f"load it again to retry (POST /api/models/{handle.spec.model_id}/load)") from exc
            raise Unavailable(f"model '{handle.spec.model_id}' is {exc.state.value}: {exc.reason}",
                              retry_after=5, code="model_unavailable") from exc

    async def _route(self, model: str, lora_scale: float | None = None) -> adapter_route.Route:
        """A ``<base>:<adapter>`` id runs on its base's worker (supervisor/workers/adapter_route.py)."""
        route = adapter_route.plan(self.models, model, lora_scale)
        if adapter_route.needs_restart(route, self.handles.get((route.model, False))):
            await self.unload(route.model)
        return route

    async def facts(self, model_id: str, embedding: bool = False) -> p.ModelFacts:
        if not embedding:
            model_id = (await self._route(model_id)).model
        handle = await self.load(model_id, embedding)
        while handle.facts is None:
            if handle.state is WorkerState.FAILED:
                raise ModelFailed(f"model '{model_id}' failed: {handle.reason}; "
                                  f"load it again to retry (POST /api/models/{model_id}/load)")
            if handle.state in (WorkerState.STOPPING, WorkerState.STOPPED):
                # Unloaded before it was ever ready: nothing will fill the facts in.
                raise Unavailable(f"model '{model_id}' was unloaded while it loaded",
                                  retry_after=1, code="model_unavailable")
            handle.changed.clear()
            await handle.changed.wait()
        return handle.facts

    async def admit(
        self,
        model: str,
        *,
        messages: list[p.ChatMessage] | None = None,
        prompt: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        params: p.SamplingParams | None = None,
        template_vars: dict[str, Any] | None = None,
        request_id: str = "",
        keep_alive: float | None = None,
        images: list[bytes] | None = None,
        lora_scale: float | None = None,
    ) -> Generation:
        """Load the model and queue one completion now, so that a refusal
        (queue full, GPU busy, model failed) raises before any output.

        ``keep_alive`` (seconds; 0 = unload after this request, negative =
        keep loaded) overrides how long the model stays loaded afterwards.
        ``lora_scale`` scales the adapter of a ``<base>:<adapter>`` model.
        """
        route = await self._route(model, lora_scale)
        handle = await self.load(route.model)
        if keep_alive is not None:
            handle.keep_alive = keep_alive
        msg = p.Generate(0, params or p.SamplingParams(), messages, prompt, tools,
                         template_vars or {}, request_id, images or [],
                         adapter=route.adapter, adapter_scale=route.scale)
        return Generation(self.on_done, model, handle, self._submit(handle, msg))

    async def _call(self, model: str, embedding: bool, msg: p.Embed | p.Tokenize) -> p.FromWorker:
        handle = await self.load(model, embedding)
        pend = self._submit(handle, msg)
        try:
            ev = await pend.events.get()
        finally:
            handle.cancel(pend)
        if isinstance(ev, (p.Error, WorkerGone)):
            raise as_api_error(ev)
        return ev

    async def embed(self, model: str, inputs: list[str]) -> p.Embeddings:
        # In batches: every reply frame stays far below the IPC frame limit
        # (2,048 inputs of 4,096 floats would be about 75 MB in one frame).
        vectors: list[list[float]] = []
        tokens = 0
        for start in range(0, max(1, len(inputs)), EMBED_BATCH):
            ev = await self._call(model, True, p.Embed(0, inputs[start : start + EMBED_BATCH]))
            assert isinstance(ev, p.Embeddings)
            vectors += ev.vectors
            tokens += ev.prompt_tokens
        return p.Embeddings(0, vectors, tokens)

    async def tokenize(self, model: str, text: str, add_special: bool = True) -> list[int]:
        ev = await self._call(model, False, p.Tokenize(0, text, add_special))
        assert isinstance(ev, p.Tokens)
        return ev.tokens

    # ------------------------------------------------------------ views

    def status(self, model_id: str) -> dict[str, Any] | None:
        handle = self.handles.get((model_id, False)) or self.handles.get((model_id, True))
        return None if handle is None else describe(handle, self.placements.get(handle_key(handle)))

    def workers(self) -> list[dict[str, Any]]:
        return [describe(h, self.placements.get(k)) for k, h in self.handles.items()]

    def readiness(self) -> dict[str, bool]:
        """Per model with a generation worker: does it serve chat and completions?

        A model's embedding worker does not make it ready: it serves only
        ``/v1/embeddings``.
        """
        return {model: h.state is WorkerState.READY
                for (model, embedding), h in self.handles.items() if not embedding}


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


