"""The worker pool: one WorkerHandle per (model, mode), and the request API.

Route handlers call :meth:`WorkerPool.generate` / ``embed`` / ``tokenize``;
worker-side failures come back as typed :mod:`supervisor.errors` exceptions.
The pool decides nothing about the GPU by itself: before admitting a request
it asks the lease (``admission``) whether model workers may run on the device.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Protocol

from supervisor.errors import (
    ApiError,
    BadRequest,
    ModelNotFound,
    Unavailable,
    UpstreamError,
)
from supervisor.models_dir import LibrarySource
from supervisor.handle import (
    NotAccepting,
    Pending,
    QueueFull,
    Timing,
    WorkerGone,
    WorkerHandle,
    WorkerSpec,
    WorkerState,
)
from worker import protocol as p

log = logging.getLogger("gpuvisor.pool")

# Worker error codes that are the client's fault.
_CLIENT_ERRORS = {"context_length_exceeded", "template_error", "invalid_grammar"}


Admission = Callable[[str], str | None]


class PoolSettings(Protocol):
    n_ctx: int
    n_gpu_layers: int
    n_threads: int
    queue_limit: int


def _no_lease(_device: str) -> str | None:
    return None


class WorkerPool:
    def __init__(self, models: LibrarySource, settings: PoolSettings, timing: Timing,
                 run_dir: Path, log_dir: Path, admission: Admission = _no_lease,
                 device: str = "cpu") -> None:
        self.models = models
        self.settings = settings
        self.timing = timing
        self.run_dir = run_dir
        self.log_dir = log_dir
        self.admission = admission
        self.device = device
        self.handles: dict[tuple[str, bool], WorkerHandle] = {}
        self._lock = asyncio.Lock()
        # Observers of finished generations (metrics): called with (model, Done).
        self.on_done: list[Callable[[str, p.Done], None]] = []

    # ------------------------------------------------------------ handles

    async def load(self, model_id: str, embedding: bool = False) -> WorkerHandle:
        """The handle for a model, starting its worker if needed."""
        self._check_admission()
        async with self._lock:
            handle = self.handles.get((model_id, embedding))
            if handle is not None and handle.state not in (WorkerState.STOPPED,):
                return handle
            path = self.models.resolve(model_id)
            if path is None:
                raise ModelNotFound(f"model '{model_id}' does not exist", param="model")
            s = self.settings
            spec = WorkerSpec(model_id, path, embedding, s.n_ctx, s.n_gpu_layers, s.n_threads, self.device)
            handle = WorkerHandle(spec, self.timing, self.run_dir, self.log_dir, s.queue_limit)
            self.handles[(model_id, embedding)] = handle
            handle.start()
            return handle

    async def unload(self, model_id: str) -> bool:
        found = False
        for key in [k for k in self.handles if k[0] == model_id]:
            found = True
            await self.handles.pop(key).stop(f"model {model_id} was unloaded")
        return found

    async def stop_all(self, reason: str = "the service is shutting down") -> None:
        handles = list(self.handles.values())
        self.handles.clear()
        await asyncio.gather(*(h.stop(reason) for h in handles))

    async def drain_all(self, timeout: float, reason: str, code: str = "worker_stopped") -> None:
        handles = list(self.handles.values())
        self.handles.clear()
        await asyncio.gather(*(h.drain(timeout, reason, code) for h in handles))

    async def vacate(self, device: str, drain_timeout: float, reason: str) -> None:
        """GPU lease hook: idle workers go now, busy ones drain, all are stopped."""
        victims = [(k, h) for k, h in self.handles.items() if h.spec.device == device]
        for key, _ in victims:
            self.handles.pop(key, None)
        await asyncio.gather(*(
            h.drain(drain_timeout if h.busy else 0.0, reason, "evicted") for _, h in victims))

    def _check_admission(self) -> None:
        why = self.admission(self.device)
        if why is not None:
            raise Unavailable(why, retry_after=10, code="gpu_busy")

    # ------------------------------------------------------------ requests

    def _submit(self, handle: WorkerHandle, msg: p.Generate | p.Embed | p.Tokenize) -> Pending:
        self._check_admission()
        try:
            return handle.submit(msg)
        except QueueFull as exc:
            raise Unavailable(str(exc), retry_after=2, code="queue_full") from exc
        except NotAccepting as exc:
            if exc.state is WorkerState.FAILED:
                raise Unavailable(f"model '{handle.spec.model_id}' failed: {exc.reason}",
                                  retry_after=30, code="model_failed") from exc
            raise Unavailable(f"model '{handle.spec.model_id}' is {exc.state.value}: {exc.reason}",
                              retry_after=5, code="model_unavailable") from exc

    async def facts(self, model_id: str, embedding: bool = False) -> p.ModelFacts:
        handle = await self.load(model_id, embedding)
        while handle.facts is None:
            if handle.state is WorkerState.FAILED:
                raise Unavailable(f"model '{model_id}' failed: {handle.reason}",
                                  retry_after=30, code="model_failed")
            handle.changed.clear()
            await handle.changed.wait()
        return handle.facts

    async def generate(
        self,
        model: str,
        *,
        messages: list[p.ChatMessage] | None = None,
        prompt: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        params: p.SamplingParams | None = None,
        template_vars: dict[str, Any] | None = None,
        request_id: str = "",
    ) -> AsyncIterator[p.Delta | p.Done]:
        """Stream one completion; leaving the iteration early cancels it."""
        handle = await self.load(model)
        msg = p.Generate(0, params or p.SamplingParams(), messages, prompt, tools,
                         template_vars or {}, request_id)
        pend = self._submit(handle, msg)
        try:
            while True:
                ev = await pend.events.get()
                if isinstance(ev, p.Delta):
                    yield ev
                elif isinstance(ev, p.Done):
                    for observe in self.on_done:
                        observe(model, ev)
                    yield ev
                    return
                else:
                    raise _as_api_error(ev)
        finally:
            handle.cancel(pend)

    async def _call(self, model: str, embedding: bool, msg: p.Embed | p.Tokenize) -> p.FromWorker:
        handle = await self.load(model, embedding)
        pend = self._submit(handle, msg)
        try:
            ev = await pend.events.get()
        finally:
            handle.cancel(pend)
        if isinstance(ev, (p.Error, WorkerGone)):
            raise _as_api_error(ev)
        return ev

    async def embed(self, model: str, inputs: list[str]) -> p.Embeddings:
        ev = await self._call(model, True, p.Embed(0, inputs))
        assert isinstance(ev, p.Embeddings)
        return ev

    async def tokenize(self, model: str, text: str, add_special: bool = True) -> list[int]:
        ev = await self._call(model, False, p.Tokenize(0, text, add_special))
        assert isinstance(ev, p.Tokens)
        return ev.tokens

    # ------------------------------------------------------------ views

    def status(self, model_id: str) -> dict[str, Any] | None:
        handle = self.handles.get((model_id, False)) or self.handles.get((model_id, True))
        return None if handle is None else describe(handle)

    def workers(self) -> list[dict[str, Any]]:
        return [describe(h) for h in self.handles.values()]

    def any_ready(self) -> bool:
        return any(h.state is WorkerState.READY for h in self.handles.values())


def describe(h: WorkerHandle) -> dict[str, Any]:
    return {
        "model": h.spec.model_id,
        "mode": "embedding" if h.spec.embedding else "generate",
        "state": h.state.value,
        "pid": h.pid,
        "restarts": h.restarts,
        "reason": h.reason,
        "queued": len(h.queue),
        "in_flight": 1 if h.inflight is not None else 0,
        "device": h.spec.device,
        "n_ctx": h.facts.n_ctx if h.facts else None,
        "stats": None if h.stats is None else {
            "busy": h.stats.busy, "requests_done": h.stats.requests_done,
            "requests_cancelled": h.stats.requests_cancelled,
            "tokens_generated": h.stats.tokens_generated},
    }


def _as_api_error(ev: p.Error | WorkerGone | p.FromWorker) -> ApiError:
    if isinstance(ev, WorkerGone):
        if ev.code in ("evicted", "worker_crashed"):
            return UpstreamError(ev.message, code=ev.code)
        return Unavailable(ev.message, retry_after=5, code=ev.code)
    if isinstance(ev, p.Error):
        if ev.code in _CLIENT_ERRORS:
            return BadRequest(ev.message, code=ev.code, param="messages")
        if ev.code == "busy":
            return Unavailable(ev.message, retry_after=1, code="worker_busy")
        return UpstreamError(ev.message, code=ev.code)
    return UpstreamError(f"unexpected worker reply {type(ev).__name__}")
