"""llama.cpp's server engine (xllamacpp) in the benchmark's own process, set up
as a gpuvisor worker sets it up (worker/engine.py): the limit that gpuvisor's
HTTP, IPC and worker layers are measured against.

Calls from several threads run concurrently in the engine's slots, as they do
in a worker; a callback sees every chunk and returning True from it stops that
generation (the engine looks at it only when it sends a chunk).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xllamacpp

from worker.engine_api import EngineOptions
from worker.engine_params import PREFILL_BATCH
from worker.engine_params import engine_params as worker_engine_params

__all__ = ["PREFILL_BATCH", "engine_params"]


def engine_params(model: Path, *, parallel: int, n_ctx: int, threads: int, sock: Path,
                  quiet: bool = True) -> xllamacpp.CommonParams:
    """The worker's own engine settings, so both sides of a comparison run the same engine."""
    p = worker_engine_params(EngineOptions(str(model), n_ctx, -1, threads, False, parallel=parallel,
                                           engine_socket=str(sock)))
    if quiet:
        # A few log lines per request: nothing a run measures, but they would
        # bury the benchmark's own output.
        p.verbosity = -1
    return p


def completion_body(prompt: str, max_tokens: int) -> dict[str, Any]:
    """What a worker sends the engine for a greedy ``/v1/completions`` request
    with ``ignore_eos`` (the worker's default sampling fields included)."""
    return {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "top_p": 1.0, "top_k": 40,
        "min_p": 0.05, "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
        "stop": [], "ignore_eos": True, "stream": True, "return_progress": True,
        "timings_per_token": True, "cache_prompt": True,
    }


@dataclass
class Stream:
    """One generation as its caller saw it (perf_counter times)."""

    start: float
    end: float = 0.0
    first: float | None = None
    tokens: int = 0
    prompt_tokens: int = 0
    # When each prefill progress report arrived.
    progress: list[float] = field(default_factory=list)
    cancelled_at: float | None = None

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.start


def aggregate_tps(streams: list[Stream]) -> float:
    """Tokens of all streams over the wall time from the first start to the last end."""
    wall = max(s.end for s in streams) - min(s.start for s in streams)
    return sum(s.tokens for s in streams) / wall


class EngineError(RuntimeError):
    pass


class InProcessEngine:
    def __init__(self, model: Path, *, parallel: int, n_ctx: int, threads: int, sock: Path) -> None:
        # A stale socket file makes the engine's listener fail to bind.
        sock.unlink(missing_ok=True)
        self.sock = sock
        self.served = False
        self.server: xllamacpp.Server | None = xllamacpp.Server(
            engine_params(model, parallel=parallel, n_ctx=n_ctx, threads=threads, sock=sock))

    def stream(self, prompt: str, max_tokens: int, cancel_at: float | None = None) -> Stream:
        """Generate; with ``cancel_at`` (a perf_counter time) stop at the first
        chunk from then on, as a worker does when its client goes away."""
        assert self.server is not None, "closed"
        s = Stream(time.perf_counter())
        errors: list[Any] = []

        def on_chunk(chunk: Any) -> bool:
            now = time.perf_counter()
            for item in chunk if isinstance(chunk, list) else [chunk]:
                _account(s, item, now, errors)
            if cancel_at is not None and now >= cancel_at:
                s.cancelled_at = now
                return True
            return False

        self.server.handle_completions(completion_body(prompt, max_tokens), on_chunk)
        s.end = time.perf_counter()
        self.served = True
        if errors:
            raise EngineError(str(errors[0]))
        return s

    def close(self) -> None:
        if self.server is not None and not self.served:
            # A Server dropped right after it was made hung in its destructor
            # (its loop had not begun and missed the stop; xllamacpp 2026.10):
            # one request first makes sure the loop runs.
            self.stream("hi", 1)
        # Dropping the last reference stops the engine's loop and frees the model.
        self.server = None
        self.sock.unlink(missing_ok=True)


def _account(s: Stream, item: dict[str, Any], now: float, errors: list[Any]) -> None:
    if "error" in item:
        errors.append(item["error"])
        return
    progress = item.get("prompt_progress")
    if progress is not None:
        s.progress.append(now)
        s.prompt_tokens = int(progress.get("total", s.prompt_tokens))
    n = int((item.get("timings") or {}).get("predicted_n", 0))
    if n > 0 and s.first is None:
        s.first = now
    s.tokens = max(s.tokens, n)
    usage = item.get("usage")
    if usage:
        s.tokens = int(usage.get("completion_tokens", s.tokens))
        s.prompt_tokens = int(usage.get("prompt_tokens", s.prompt_tokens))
