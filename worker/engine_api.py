"""The one interface a model worker serves through (``EngineApi``), the
options an engine is loaded with, and the registry of engines by name.

``WorkerServer`` (worker/server.py) speaks the IPC protocol and knows an
engine only by :class:`EngineApi`. Each engine lives in its own module,
named in :data:`ENGINES` and imported only by a worker started for it
(``python -m worker --engine NAME``), so a llama.cpp worker never imports
torch, and this module imports no engine at all. An engine module provides
``load(opts: EngineOptions) -> EngineApi``, which raises :class:`LoadError`
when the model cannot be loaded (the worker then exits with
``EXIT_LOAD_FAILED``, and the parent does not restart it).

Threads, the chosen design: the worker calls the engine from a pool of
threads, one per request, sized to the engine's slots (``opts.parallel``)
plus two for tokenize and embed calls beside them. Each call blocks its
thread until the request ends. That suits xllamacpp, whose calls block and
stream through a callback on the calling thread, and whose slots run calls
from several threads concurrently. An async engine (vLLM's ``AsyncLLM``)
runs its own event loop in one dedicated thread that it starts at load and
stops in :meth:`EngineApi.close`; its blocking methods submit coroutines to
that loop with ``asyncio.run_coroutine_threadsafe`` and wait on the future
(a cancel sets the request's ``threading.Event``; the engine aborts the
request in its loop). The worker's own loop, which reads frames and sends
heartbeats, then never waits on the engine's.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol, cast

from worker.protocol import Delta, Done, Error, Generate, ModelFacts, RopeOptions, SpeculativeOptions, Started

# What an engine sends while it runs one Generate: Started once the request
# is taken, Deltas, then exactly one Done or Error.
Emit = Callable[[Started | Delta | Done | Error], None]

# Engine names (``--engine``) and the module that holds each; a module is
# imported only when a worker is started for its engine.
ENGINES: Mapping[str, str] = MappingProxyType({
    "llamacpp": "worker.engine",
    "vllm": "worker.engine_vllm",
})
DEFAULT_ENGINE = "llamacpp"


class LoadError(Exception):
    """The model cannot be loaded (bad file, missing file, does not fit, no such engine)."""


class UnknownEngine(LoadError):
    """``--engine`` names no engine this worker has."""


class Refused(Exception):
    """A request the engine will not run, and why: its ``code`` is the
    protocol's error code (``context_length_exceeded``, ``invalid_request``),
    which the parent maps to the HTTP status as for a generation's Error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class EngineOptions:
    """What a worker loads and how (from its command line, worker/__main__.py).

    The same for every engine; an engine ignores what it has no use for
    (the llama.cpp cache types, its private socket) and says so in its module.
    """

    model_path: str
    n_ctx: int
    n_gpu_layers: int
    n_threads: int
    embedding: bool
    cache_type: str = "f16"
    # Speculative decoding: mode, draft model and draft lengths.
    speculative: SpeculativeOptions = SpeculativeOptions()
    # Generations run at once, each in its own slot of n_ctx tokens.
    parallel: int = 1
    # Where the engine's own HTTP listener binds (a Unix socket, never TCP).
    engine_socket: str = ""
    # The model's image projector (mmproj GGUF); "" = text only.
    mmproj: str = ""
    # LoRA adapters to hold, applied per request that names one.
    lora: list[str] = field(default_factory=list)
    # Shares of the layers per visible GPU (a split over several); empty: one GPU.
    tensor_split: tuple[float, ...] = ()
    # A chat template file that replaces the model's own (a model setting); "" = none.
    chat_template_file: str = ""
    # YaRN scaling past the native context (llama.cpp only); none by default.
    rope: RopeOptions = RopeOptions()


@dataclass
class Counters:
    """What an engine has served since it started (the worker's heartbeat
    stats). Counted from request threads, hence the lock."""

    requests_done: int = 0
    requests_cancelled: int = 0
    tokens_generated: int = 0
    # Speculative decoding: tokens drafted, and those the target accepted.
    draft_tokens: int = 0
    draft_accepted: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, finish: str, tokens: int, drafted: int = 0, accepted: int = 0) -> None:
        with self.lock:
            self.tokens_generated += tokens
            self.draft_tokens += drafted
            self.draft_accepted += accepted
            if finish == "cancelled":
                self.requests_cancelled += 1
            else:
                self.requests_done += 1

    def drafted(self, drafted: int, accepted: int) -> None:
        """Speculative decoding counted apart from requests (an engine that
        reports drafting per step, not per request: vLLM)."""
        with self.lock:
            self.draft_tokens += drafted
            self.draft_accepted += accepted


class EngineApi(Protocol):
    """A loaded model, as ``WorkerServer`` uses it.

    Every method but ``close`` is called on a request thread, several at
    once (up to ``opts.parallel`` generations, plus tokenize and embed calls),
    and blocks until its request ends. An exception raised by one ends that
    request with an ``internal_error`` and leaves the worker serving.
    """

    @property
    def opts(self) -> EngineOptions:
        """The options it was loaded with (``parallel`` sizes the thread pool)."""
        ...

    @property
    def facts(self) -> ModelFacts:
        """What the parent learns in ``Hello``: context, vocab, template, modalities."""
        ...

    @property
    def counters(self) -> Counters:
        """Requests and tokens served so far, read for every heartbeat."""
        ...

    def generate(self, req: Generate, emit: Emit, cancelled: threading.Event) -> None:
        """Run one generation, sending ``Started``, ``Delta``s and exactly one
        ``Done`` or ``Error`` through ``emit``. A refusal of the request (too
        long, bad grammar, bad images) is an ``Error`` before ``Started``.
        Once ``cancelled`` is set, stop within a few tokens (also during the
        prefill) and end with ``Done(finish_reason="cancelled")``."""
        ...

    def embed(self, inputs: list[str]) -> tuple[list[list[float]], int]:
        """One vector per input, in order, and the prompt tokens they took
        (only when loaded with ``opts.embedding``). Raises :class:`Refused`
        for inputs it will not embed (one longer than the context)."""
        ...

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """The model's tokens for ``text``, special tokens parsed."""
        ...

    def close(self) -> None:
        """Release what ``load`` started (threads, event loops, child
        processes), called on a thread once the parent asked the worker to
        stop. A worker whose parent is gone exits at once without it, so a
        child process of the engine must watch for that itself."""
        ...


Loader = Callable[[EngineOptions], EngineApi]


def loader(name: str) -> Loader:
    """The ``load`` of engine ``name``, its module imported now.

    Raises :class:`UnknownEngine` for a name not in :data:`ENGINES` and
    :class:`LoadError` when its module cannot be imported here (its library
    is not installed in this Python environment): neither is a crash, and
    restarting would not help.
    """
    module_name = ENGINES.get(name)
    if module_name is None:
        raise UnknownEngine(f"unknown engine {name!r}; this worker has {', '.join(sorted(ENGINES))}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise LoadError(f"the {name} engine cannot be imported in this Python environment: {exc}") from exc
    return cast(Loader, module.load)
