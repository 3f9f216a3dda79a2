"""What comes back from a worker, as the pool's callers see it.

``Generation`` streams one admitted completion's outputs; ``as_api_error``
turns a worker's error or a ``WorkerGone`` into the typed API error
(supervisor/errors.py) a route answers with. A refusal of something in the
request is a ``Rejected`` with a typed ``Blame``: the pool does not know the
field names of the API that asked, so each API maps the cause once.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable

import msgspec

from supervisor.errors import (
    NO_RETRY,
    ApiError,
    BadRequest,
    ModelFailed,
    Unavailable,
    UpstreamError,
)
from supervisor.workers.handle import WorkerHandle
from supervisor.workers.queue import Pending, WorkerGone
from worker import protocol as p

log = logging.getLogger("gpuvisor.pool")

class Blame(enum.Enum):
    """What in a request a worker refused; each API names its own field for it."""

    PROMPT = "prompt"  # the prompt as a whole: too long, or its template failed on it
    GRAMMAR = "grammar"  # the constrained-output grammar (a JSON format or a forced call)
    IMAGES = "images"  # the request's images (the parent checks them first)


class Rejected(BadRequest):
    """A worker's refusal of a request, with its typed cause and no field yet:
    the route that made the request maps the cause to its own field, once."""

    def __init__(self, message: str, *, code: str, cause: Blame) -> None:
        super().__init__(message, code=code)
        self.cause = cause

    def blaming(self, param: str) -> BadRequest:
        return BadRequest(self.message, param=param, code=self.code)


# Worker error codes that are the client's fault, with their cause (None:
# nothing in particular, e.g. a malformed request).
_CLIENT_ERRORS: dict[str, Blame | None] = {
    "context_length_exceeded": Blame.PROMPT, "template_error": Blame.PROMPT,
    "invalid_grammar": Blame.GRAMMAR, "invalid_request": None,
    "invalid_image": Blame.IMAGES, "image_too_large": Blame.IMAGES, "too_many_images": Blame.IMAGES,
    "vision_unavailable": Blame.IMAGES, "invalid_audio": Blame.IMAGES, "audio_unavailable": Blame.IMAGES}

# How a client or its admin gets a longer context (the 400 says it).
CONTEXT_HINT = ("For a longer context, load the model with a larger n_ctx: the n_ctx setting "
                "(or [model_defaults.\"<model>\"] n_ctx in the config), or POST /api/models/<model>/load "
                "with {\"n_ctx\": N}")
_SCALED_HINT = ("{n} is as far as its YaRN scaling reaches: for more, load it with a larger n_ctx"
                " (or rope_scale) and rope_scaling \"yarn\", e.g. POST /api/models/<model>/load with"
                " {{\"n_ctx\": N, \"rope_scaling\": \"yarn\"}}")
_NATIVE_HINT = ("{n} is the model's whole native context, so a larger n_ctx alone is capped there."
                " Past it takes RoPE scaling: POST /api/models/<model>/load with"
                " {{\"n_ctx\": N, \"rope_scaling\": \"yarn\"}} (or rope_scaling = \"yarn\" in"
                " [model_defaults.\"<model>\"]); how well a model reads past its trained length varies")
_WHOLE_HINT = "{n} is the model's whole context; this engine takes no scaling past it"


def context_hint(handle: WorkerHandle | None) -> str:
    """The advice for a prompt over the context: a larger n_ctx only where
    the worker runs less than it could have (the engine caps a slot at the
    model's training context, or at what YaRN scaling reaches)."""
    facts = handle.facts if handle is not None else None
    if handle is None or facts is None or facts.n_ctx < facts.n_ctx_train:
        return CONTEXT_HINT
    if handle.spec.engine != "llamacpp":
        return _WHOLE_HINT.format(n=facts.n_ctx)
    return (_SCALED_HINT if handle.spec.rope.freq_scale else _NATIVE_HINT).format(n=facts.n_ctx)


class Generation:
    """The outputs of one admitted completion, ending with ``Done``.

    ``aclose()`` withdraws or cancels it in the worker (a no-op once it has
    finished); unlike a generator's, it works even if never iterated.

    ``time_limit`` (seconds, 0 = none) bounds how long it runs once the
    worker took it: then it is cancelled in the worker, and its ``Done``
    says ``length`` with ``timed_out``, as if it had reached its token limit.
    The clock runs in the parent, so it holds for every engine, and a
    client never waits on a generation that would not end.
    """

    def __init__(self, on_done: list[Callable[[str, p.Done], None]], model: str, handle: WorkerHandle,
                 pend: Pending, time_limit: float = 0.0) -> None:
        self._on_done = on_done
        self._model = model
        self._handle = handle
        self._pend = pend
        self._ended = False
        # An output ``accepted()`` read past the worker's Started, kept for iteration.
        self._ahead: p.FromWorker | WorkerGone | None = None
        self._accepted = False
        self._time_limit = time_limit
        self._timer: asyncio.TimerHandle | None = None
        self._timed_out = False

    def _taken(self) -> None:
        """The worker took the request: its clock starts."""
        self._accepted = True
        if self._time_limit > 0 and self._timer is None and not self._ended:
            self._timer = asyncio.get_running_loop().call_later(self._time_limit, self._expire)

    def _expire(self) -> None:
        if not self._ended:
            log.warning("request %d on %s ran for its time limit (%g s): cancelled",
                        self._pend.id, self._model, self._time_limit)
            self._timed_out = True
            self._handle.cancel(self._pend)

    def __aiter__(self) -> Generation:
        return self

    async def accepted(self) -> None:
        """Wait until the worker takes the request (its prompt fits, prefill
        begins). A rejection (too long, bad grammar, worker gone) raises here
        as an ``ApiError``. Cancelling the wait leaves the request queued."""
        if self._ended or self._accepted:
            return
        ev = await self._pend.events.get()
        self._taken()
        if isinstance(ev, p.Started):
            return
        self._ahead = ev
        if not isinstance(ev, (p.Delta, p.Done)):
            await self.aclose()
            raise as_api_error(ev, self._handle)

    async def _next(self) -> p.FromWorker | WorkerGone:
        if self._ahead is not None:
            ev, self._ahead = self._ahead, None
            return ev
        while isinstance(ev := await self._pend.events.get(), p.Started):
            self._taken()
        if not self._accepted:
            self._taken()  # an engine that sends no Started: its first output
        return ev

    async def __anext__(self) -> p.Delta | p.Done:
        if self._ended:
            raise StopAsyncIteration
        try:
            ev = await self._next()
        except BaseException:
            await self.aclose()
            raise
        if isinstance(ev, p.Delta):
            return ev
        await self.aclose()
        if isinstance(ev, p.Done):
            if self._timed_out and ev.finish_reason == "cancelled":
                ev = msgspec.structs.replace(ev, finish_reason="length", timed_out=True)
            for observe in self._on_done:
                observe(self._model, ev)
            return ev
        raise as_api_error(ev, self._handle)

    async def aclose(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if not self._ended:
            self._ended = True
            self._handle.cancel(self._pend)


def as_api_error(ev: p.Error | WorkerGone | p.FromWorker, handle: WorkerHandle | None = None) -> ApiError:
    """The API error for ``ev``; ``handle`` (its worker) shapes the advice
    for a prompt over the context."""
    if isinstance(ev, WorkerGone):
        if ev.code == "worker_crashed":
            # The same request may crash the restarted worker again.
            return UpstreamError(ev.message, code=ev.code, headers=dict(NO_RETRY))
        if ev.code == "evicted":
            return UpstreamError(ev.message, code=ev.code)
        if ev.code == "model_failed":
            return ModelFailed(ev.message)
        return Unavailable(ev.message, retry_after=5, code=ev.code)
    if isinstance(ev, p.Error):
        if ev.code in _CLIENT_ERRORS:
            cause = _CLIENT_ERRORS[ev.code]
            message = (f"{ev.message}. {context_hint(handle)}" if ev.code == "context_length_exceeded"
                       else ev.message)
            if cause is None:
                return BadRequest(message, code=ev.code)
            return Rejected(message, code=ev.code, cause=cause)
        if ev.code == "busy":
            return Unavailable(ev.message, retry_after=1, code="worker_busy")
        return UpstreamError(ev.message, code=ev.code)
    return UpstreamError(f"unexpected worker reply {type(ev).__name__}")
