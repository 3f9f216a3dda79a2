"""The worker pool: one WorkerHandle per (model, mode), and the request API.

Route handlers call :meth:`WorkerPool.admit` / ``embed`` / ``tokenize``;
worker-side failures come back as typed :mod:`supervisor.errors` exceptions.
The pool decides nothing about the GPU by itself: before admitting a request
it asks the lease (``admission``) whether model workers may run on the
worker's devices; a new worker is placed on the GPUs no job holds
(supervisor/workers/gpu_room.py) and booked on them in the lease.

On a Ray cluster the GPUs are the nodes' (supervisor/workers/cluster_nodes.py):
a node that leaves ends its workers with the reason, and their models are
loaded again wherever there is room (supervisor/workers/node_loss.py).

What a load asks of a worker is worked out in supervisor/workers/launch_spec.py,
how a request is queued on one in supervisor/workers/submit.py, and what the
pool shows of its workers in supervisor/workers/views.py.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, Protocol

import msgspec

from supervisor.config import ModelSettings, parse_duration
from supervisor.errors import ApiError, DeviceBusy, ModelFailed, ModelNotFound
from supervisor.generation import sampling
from supervisor.models.draft import SpeculativePlan, plan_speculative
from supervisor.models.gpu_place import DEFAULT_HEADROOM, GpuPlacement
from supervisor.models.library import ModelEntry
from supervisor.models.memfit import ContextDecision
from supervisor.models.slots import SlotAsk, slot_ask
from supervisor.models.source import LibrarySource
from supervisor.workers import adapter_route, launch_spec, submit, views
from supervisor.workers.cluster_nodes import ClusterNodes, NodeBook
from supervisor.workers.connection import Endpoint
from supervisor.workers.crash_keys import KeyCrashes, crash_counts
from supervisor.workers.drafting import SpeculativeBook
from supervisor.workers.gpu_room import (
    Bookings,
    GpuRoom,
    booking_key,
    handle_key,
    worker_devices,
)
from supervisor.workers.handle import WorkerHandle, WorkerState
from supervisor.workers.node_loss import NodeLoss
from supervisor.workers.poison import PoisonTracker
from supervisor.workers.queue import Pending, WorkerGone
from supervisor.workers.ray_launcher import RayLauncher, launcher_for
from supervisor.workers.replies import Generation, as_api_error
from supervisor.workers.room import Room, holds_memory
from supervisor.workers.spec import Timing
from supervisor.workers.views import describe
from worker import protocol as p

# Generation: the routes stream an admitted completion through it; describe
# (supervisor/workers/views.py) stays importable from here.
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
    vllm_python: str  # the Python of the vLLM environment ("" = none)
    worker_listen: str  # where workers dial back (supervisor/workers/connection.py)
    ray_address: str  # a Ray cluster to start the workers on ("" = here): ray_launcher.py
    # The runaway guard: output tokens of a request that sets no limit (0 =
    # none), and seconds a request may run once its worker took it (0 = no limit).
    default_max_tokens: int
    request_timeout_s: float
    # Crashes a caller may be blamed for within the window before it is
    # refused (supervisor/workers/crash_keys.py); 0 = no refusal per caller.
    caller_crash_limit: int
    caller_crash_window_s: float
    # Seconds a request may wait for a slot (0 = no limit): supervisor/workers/queue.py.
    queue_timeout_s: float

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
        # Where workers start: here (None: the handle's local launcher) or on a Ray cluster.
        self.launcher = launcher_for(cfg.ray_address, log_dir)
        # On a cluster: its nodes' GPUs, in the lease and for placement.
        self.cluster: ClusterNodes | None = None
        # Nodes leaving and joining (supervisor/workers/node_loss.py).
        self.node_loss = NodeLoss(self.handles, self._forget, self._signal, self.load,
                                  lambda entries: self.models.library.set_node_models(entries),
                                  lambda: self.cluster.serving() if self.cluster is not None else None)
        if isinstance(self.launcher, RayLauncher) and isinstance(bookings, NodeBook):
            self.cluster = ClusterNodes(self.launcher, bookings, self.node_loss.lost, on_joined=self.node_loss.joined)
            gpus = GpuRoom(None, (), admission, gpus.headroom if gpus is not None else DEFAULT_HEADROOM,
                           nodes=self.cluster)
        self.room = Room(cfg, self.handles, self.fits, self._drop, self._changed, gpus=gpus,
                         placements=self.placements)
        # Observers of finished generations (metrics): called with (model, Done).
        self.on_done: list[Callable[[str, p.Done], None]] = []
        # Requests in flight during worker crashes (supervisor/workers/poison.py),
        # and the callers they came from (supervisor/workers/crash_keys.py).
        self.poison = PoisonTracker()
        self.crash_keys = KeyCrashes(cfg.caller_crash_limit, cfg.caller_crash_window_s)
        # Each model's drafting plan and last refusal (supervisor/workers/drafting.py).
        self.speculative = SpeculativeBook()

    def start(self) -> None:
        self._reaper = asyncio.create_task(self._reap_idle(), name="keep-alive")
        if self.cluster is not None:
            self.cluster.start()

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
            if not entry.usable:
                # A header the library refused (one the engine would abort on,
                # or cannot read), no vLLM environment, or HF files it cannot
                # load: nothing to start, and no crash to count.
                raise ModelFailed(f"model '{model_id}' is unusable: {entry.reason}")
            plan = await self._plan_speculative(entry, settings, embedding)
            if handle is not None and self._reusable(handle, entry, options, settings, plan):
                handle.keep_alive = parse_duration(settings.keep_alive or 0)
                handle.enable_thinking = settings.enable_thinking
                return handle
            # A context set for this model in the config is as explicit as one in a load body.
            own = self.cfg.model_defaults.get(model_id)
            explicit_ctx = bool(options and options.n_ctx) or (own is not None and own.n_ctx is not None)
            # Before anything is stopped for it: a load that can never fit evicts nothing.
            await self.room.check_fits_at_all(entry, settings, explicit_ctx, self._slots(settings, embedding),
                                              embedding, draft=plan)
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

    def _reusable(self, handle: WorkerHandle, entry: ModelEntry, options: ModelSettings | None,
                  settings: ModelSettings, plan: SpeculativePlan) -> bool:
        """Is the running worker what this load asks for (so the load is a no-op)?"""
        return (handle.state is not WorkerState.FAILED
                and launch_spec.unchanged(handle, entry, options, settings, self.fits.get(handle_key(handle)))
                and handle.spec.speculative == plan.options)

    def _slots(self, settings: ModelSettings, embedding: bool) -> SlotAsk:
        return slot_ask(settings, self.device, embedding=embedding)

    async def _start_handle(self, key: tuple[str, bool], entry: ModelEntry, settings: ModelSettings,
                            explicit_ctx: bool, plan: SpeculativePlan | None = None) -> WorkerHandle:
        model_id, embedding = key
        slots = self._slots(settings, embedding)
        await self.room.make_room_by_count(model_id)
        plan = plan or SpeculativePlan()
        placing = asyncio.get_running_loop().time()
        # On nodes' own disks: placed only where its file is there, with its path on that node.
        entry, decision, placed = await self.room.fit_held(entry, settings, explicit_ctx, slots, embedding, plan,
                                                           lambda again: self.models.library.get(again))
        if placed.node:
            # On a cluster the readings come from the nodes' agents: how long that took is worth a line.
            log.info("%s placed on %s in %.2fs: %s", model_id, ", ".join(placed.devices),
                     asyncio.get_running_loop().time() - placing, placed.reason)
        spec = launch_spec.build_spec(key, entry, settings, decision, placed, plan, parallel=slots.base,
                                      n_threads=self.cfg.n_threads, default_ctx=self.cfg.n_ctx,
                                      device=self.device, pinned=self.room.gpus is not None,
                                      vllm_python=self.cfg.vllm_python)
        handle = WorkerHandle(spec, self.timing, self.run_dir, self.log_dir, self.cfg.queue_limit, self._clock,
                              queue_timeout=self.cfg.queue_timeout_s,
                              launcher=self.launcher, endpoint=Endpoint.parse(self.cfg.worker_listen))
        handle.keep_alive = parse_duration(settings.keep_alive or 0)
        handle.enable_thinking = settings.enable_thinking
        handle.crash_counts = lambda in_flight: crash_counts(self.poison, self.crash_keys, model_id, in_flight)
        handle.on_failed = functools.partial(self._failed, key, handle)
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

    def _failed(self, key: tuple[str, bool], handle: WorkerHandle) -> None:
        """A worker was marked failed: it uses no device now. It stays in the
        pool, failed with its reason, until the model is loaded again
        explicitly or unloaded (nothing evicts it: supervisor/workers/room.py)."""
        if self.handles.get(key) is handle and self.bookings is not None:
            self.bookings.unbook_worker(booking_key(key))

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
        if self.cluster is not None:
            await self.cluster.stop()
        await self.node_loss.stop()
        handles = list(self.handles.values())
        for key in list(self.handles):
            self._forget(key)
        await asyncio.gather(*(h.stop(reason) for h in handles))

    async def vacate(self, device: str, drain_timeout: float, reason: str) -> None:
        """GPU lease hook: idle workers go now, busy ones drain, all are stopped.
        A failed worker has no process there and stays, failed."""
        victims = [(k, h) for k, h in self.handles.items()
                   if device in worker_devices(h) and holds_memory(h)]
        freed = [(self.placements[k], fit.needed_bytes) for k, _ in victims
                 if k in self.placements and (fit := self.fits.get(k)) is not None]
        if self.room.gpus is not None and freed:
            # Read before they stop: the job's lease waits for this memory.
            await self.room.gpus.expect_freed(freed)
        for key, _ in victims:
            self._forget(key)
        await asyncio.gather(*(
            h.drain(drain_timeout if h.busy else 0.0, reason, "evicted") for _, h in victims))

    def set_node_models(self, entries: list[ModelEntry]) -> None:
        """The models held on nodes' own disks (the job runner's records:
        supervisor/lab/node_files.py), listed with their nodes (node_loss.py)."""
        self.node_loss.set_node_models(entries)

    def _check_admission(self, handle: WorkerHandle | None) -> None:
        """503 naming the holder when a job holds (or frees) a device of the
        worker; for a worker not placed yet, when every device is taken."""
        devices = worker_devices(handle) if handle is not None else (
            self.room.gpus.gpu_devices() if self.room.gpus is not None else [self.device])
        refused = [why for why in map(self.admission, devices) if why is not None]
        if refused and (handle is not None or len(refused) == len(devices)):
            raise DeviceBusy(refused[0])

    # ------------------------------------------------------------ requests

    def _submit(self, handle: WorkerHandle, msg: p.Generate | p.Embed | p.Tokenize, caller: str = "") -> Pending:
        self._check_admission(handle)
        return submit.submit(handle, msg, self.poison, self.crash_keys, caller)

    async def _route(self, model: str, lora_scale: float | None = None) -> adapter_route.Route:
        """A ``<base>:<adapter>`` id runs on its base's worker (supervisor/workers/adapter_route.py)."""
        route = adapter_route.plan(self.models, model, lora_scale)
        entry = self.models.entry(route.model) if route.adapter else None
        adapters = entry.adapters if entry is not None else []
        if adapter_route.needs_restart(route, self.handles.get((route.model, False)), adapters):
            await self.unload(route.model)
        return route

    async def facts(self, model_id: str, embedding: bool = False) -> p.ModelFacts:
        if not embedding:
            model_id = (await self._route(model_id)).model
        handle = await self.load(model_id, embedding)
        return await submit.wait_facts(handle, model_id)

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
        caller: str = "",
        sampling_asked: Collection[str] = (),
    ) -> Generation:
        """Load the model and queue one completion now, so that a refusal
        (queue full, GPU busy, model failed) raises before any output.

        ``keep_alive`` (seconds; 0 = unload after this request, negative =
        keep loaded) overrides how long the model stays loaded afterwards.
        ``lora_scale`` scales the adapter of a ``<base>:<adapter>`` model.
        ``caller`` is who asked (supervisor/api/callers.py): crashes are blamed on it.
        A chat without an ``enable_thinking`` template variable gets the
        model's setting of it, if any. The runaway guard applies here, to
        every API alike: a request with no token limit gets
        ``default_max_tokens``, a limit above the model's context is clamped
        to it (``output_ceiling``), and ``request_timeout_s`` bounds how long it runs.
        So do the model's sampling defaults: each sampling field not in
        ``sampling_asked`` (those the request set) is filled
        (supervisor/generation/sampling.py).
        """
        route = await self._route(model, lora_scale)
        handle = await self.load(route.model)
        if keep_alive is not None:
            handle.keep_alive = keep_alive
        params = sampling.fill(params or p.SamplingParams(), sampling_asked,
                               self.sampling_defaults(route.model))
        template_vars = template_vars or {}
        if messages is not None and handle.enable_thinking is not None and "enable_thinking" not in template_vars:
            template_vars = {**template_vars, "enable_thinking": handle.enable_thinking}
        if params.max_tokens is None and self.cfg.default_max_tokens:
            params = msgspec.structs.replace(params, max_tokens=self.cfg.default_max_tokens)
        params = output_ceiling(handle, model, params, request_id)
        msg = p.Generate(0, params, messages, prompt, tools,
                         template_vars, request_id, images or [],
                         adapter=route.adapter, adapter_scale=route.scale)
        return Generation(self.on_done, model, handle, self._submit(handle, msg, caller),
                          time_limit=self.cfg.request_timeout_s)

    def sampling_defaults(self, model_id: str) -> dict[str, sampling.Setting]:
        """The sampling a request to the model gets for each field it leaves out."""
        return sampling.in_effect(self.models.entry(model_id), self.cfg.model_settings(model_id))

    async def _call(self, model: str, embedding: bool, msg: p.Embed | p.Tokenize,
                    caller: str = "") -> p.FromWorker:
        handle = await self.load(model, embedding)
        pend = self._submit(handle, msg, caller)
        try:
            ev = await pend.events.get()
        finally:
            handle.cancel(pend)
        if isinstance(ev, (p.Error, WorkerGone)):
            raise as_api_error(ev, handle)
        return ev

    async def embed(self, model: str, inputs: list[str], caller: str = "") -> p.Embeddings:
        # In batches: every reply frame stays far below the IPC frame limit
        # (2,048 inputs of 4,096 floats would be about 75 MB in one frame).
        vectors: list[list[float]] = []
        tokens = 0
        for start in range(0, max(1, len(inputs)), EMBED_BATCH):
            ev = await self._call(model, True, p.Embed(0, inputs[start : start + EMBED_BATCH]), caller)
            assert isinstance(ev, p.Embeddings)
            vectors += ev.vectors
            tokens += ev.prompt_tokens
        return p.Embeddings(0, vectors, tokens)

    async def tokenize(self, model: str, text: str, add_special: bool = True, embedding: bool = False) -> list[int]:
        """The model's tokens for ``text``; ``embedding``: asked of its embedding
        worker (the one that will embed the text), so no generation worker loads."""
        ev = await self._call(model, embedding, p.Tokenize(0, text, add_special))
        assert isinstance(ev, p.Tokens)
        return ev.tokens

    # ------------------------------------------------------------ views
    # What they show is built in supervisor/workers/views.py.

    def status(self, model_id: str) -> dict[str, Any] | None:
        return views.model_status(self.handles, self.placements, model_id)

    def workers(self) -> list[dict[str, Any]]:
        return views.worker_list(self.handles, self.placements)

    def readiness(self) -> dict[str, bool]:
        """Per model with a generation worker: does it serve chat and completions?"""
        return views.readiness(self.handles)


def output_ceiling(handle: WorkerHandle, model: str, params: p.SamplingParams,
                   request_id: str = "") -> p.SamplingParams:
    """A token limit within the model's context: no request can write more
    tokens than its slot holds (the prompt included), so a larger limit (the
    chat page's 100000, 2^63, more than 64 bits) is clamped to the context,
    and the engine stops where the slot is full (``length``). Clamped, not
    refused: clients ask for "as much as you can" with a big number, and
    llama.cpp's own server takes it so. The context is the worker's own once
    its facts are in, else the one it is started with, so a request need
    not wait for the load."""
    limit = params.max_tokens
    ceiling = handle.facts.n_ctx if handle.facts is not None else handle.spec.n_ctx
    if limit is None or not 0 < ceiling < limit:
        return params
    # Debug, not info: the chat page asks for more than any context on every turn.
    log.debug("%s: max_tokens %d clamped to the context of %s (%d)", request_id or "request", limit, model, ceiling)
    return msgspec.structs.replace(params, max_tokens=ceiling)
