"""The worker's IPC loop: one connection to the parent, a thread per request.

Frames are read on the asyncio loop; each generation, embedding or
tokenization runs on its own thread of a pool sized to the engine's slots,
and the engine batches the generations running at once. Messages produced by
those threads are queued and written by the loop, merging consecutive deltas
of one request when the loop falls behind. The engine is known here only by
its interface (``EngineApi``, worker/engine_api.py, which says why threads).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import msgspec

from worker import protocol as p
from worker.dial import Dial, HandshakeRefused, handshake, read_secret
from worker.engine_api import EngineApi, EngineOptions, LoadError, Refused, loader

log = logging.getLogger("gpuvisor.worker")


def watch_stdin() -> None:
    """Exit as soon as the parent is gone (its end of our stdin closes)."""

    def run() -> None:
        # os.read, not sys.stdin: a daemon thread blocked inside the buffered
        # reader would abort the interpreter at exit.
        while os.read(0, 65536):
            pass
        os._exit(p.EXIT_OK)

    threading.Thread(target=run, name="stdin-watch", daemon=True).start()


class Outbox:
    """Thread-safe queue of outgoing messages, flushed on the event loop.

    Deltas are flushed at most once per ``coalesce_s``: at thousands of
    tokens per second, one frame (and one loop wake-up, one SSE chunk in the
    parent) per token costs more CPU than the tokens themselves. The first
    delta after a pause and every terminal message go out at once.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, writer: asyncio.StreamWriter,
                 coalesce_s: float = 0.002) -> None:
        self._loop = loop
        self._writer = writer
        self._codec = p.worker_codec()
        self._lock = threading.Lock()
        self._pending: list[msgspec.Struct] = []
        self._scheduled = False
        self._coalesce_s = coalesce_s
        self._last_flush = 0.0

    def put(self, msg: msgspec.Struct) -> None:
        with self._lock:
            last = self._pending[-1] if self._pending else None
            if isinstance(msg, p.Delta) and isinstance(last, p.Delta) and last.id == msg.id:
                probs = None if last.logprobs is None and msg.logprobs is None else [
                    *(last.logprobs or []), *(msg.logprobs or [])]
                self._pending[-1] = p.Delta(msg.id, last.text + msg.text, last.n_tokens + msg.n_tokens, probs)
            else:
                self._pending.append(msg)
            if self._scheduled:
                return
            self._scheduled = True
        self._loop.call_soon_threadsafe(self._arm)

    def send(self, msg: msgspec.Struct) -> None:
        """Send from the loop thread, after anything already queued."""
        self.put(msg)

    def _arm(self) -> None:
        with self._lock:
            only_deltas = all(isinstance(m, p.Delta) for m in self._pending)
        wait = self._last_flush + self._coalesce_s - self._loop.time()
        if only_deltas and wait > 0:
            self._loop.call_later(wait, self._flush)
        else:
            self._flush()

    def _flush(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
            self._scheduled = False
        self._last_flush = self._loop.time()
        if batch and not self._writer.is_closing():
            self._writer.write(b"".join(self._frame(m) for m in batch))

    def _frame(self, msg: msgspec.Struct) -> bytes:
        """One message's frame; a reply that cannot be sent ends its request
        with an error instead of vanishing (the parent would wait forever)."""
        try:
            return self._codec.encode(msg)
        except (p.FrameTooLarge, OverflowError) as exc:
            req_id = getattr(msg, "id", -1)
            log.error("reply to request %s cannot be sent: %s", req_id, exc)
            return self._codec.encode(p.Error(req_id if isinstance(req_id, int) else -1, "reply_too_large",
                                              f"the reply cannot be sent to the parent: {exc}"))


class WorkerServer:
    def __init__(self, engine: EngineApi, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 heartbeat_s: float) -> None:
        self.engine = engine
        self.reader = reader
        self.writer = writer
        self.heartbeat_s = heartbeat_s
        self.outbox = Outbox(asyncio.get_running_loop(), writer)
        # One thread per slot, plus room for tokenize/embed calls beside them:
        # the parent sends at most ``parallel`` requests at once.
        workers = max(1, engine.opts.parallel) + 2
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="request")
        self.codec = p.worker_codec()
        self.cancels: dict[int, threading.Event] = {}
        self.active: set[int] = set()
        self.pending = 0

    def stats(self) -> p.WorkerStats:
        c = self.engine.counters
        active = min(self.active, default=None)
        return p.WorkerStats(self.pending > 0, c.requests_done, c.requests_cancelled,
                             c.tokens_generated, active, len(self.active), c.draft_tokens, c.draft_accepted)

    async def heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            self.outbox.send(p.Heartbeat(self.stats()))

    async def serve(self) -> int:
        beat = asyncio.create_task(self.heartbeat(), name="heartbeat")
        try:
            return await self._read_loop()
        finally:
            beat.cancel()
            for ev in self.cancels.values():
                ev.set()
            self.executor.shutdown(wait=False, cancel_futures=True)

    async def _read_loop(self) -> int:
        while True:
            try:
                body = await p.read_frame(self.reader)
            except p.ProtocolError as exc:
                # A broken stream cannot be resynchronised: report and stop.
                self.outbox.send(p.Error(-1, "protocol_error", str(exc)))
                return 1
            if body is None:
                return p.EXIT_OK
            try:
                msg = self.codec.decode(body)
            except p.InvalidMessage as exc:
                self.outbox.send(p.Error(-1, "invalid_message", str(exc)))
                continue
            if isinstance(msg, p.Shutdown):
                return p.EXIT_OK
            self.dispatch(msg)

    def dispatch(self, msg: p.ToWorker) -> None:
        match msg:
            case p.Generate():
                self._start(msg.id, lambda ev: self.engine.generate(msg, self._logged(msg), ev))
            case p.Embed():
                self._start(msg.id, lambda ev: self._embed(msg))
            case p.Cancel():
                ev = self.cancels.get(msg.id)
                if ev is not None:
                    ev.set()
            case p.Ping():
                self.outbox.send(p.Pong(msg.seq, self.stats()))
            case p.Tokenize():
                self._start(msg.id, lambda ev: self.outbox.put(
                    p.Tokens(msg.id, self.engine.tokenize(msg.text, msg.add_special))))

    def _logged(self, msg: p.Generate) -> Callable[[msgspec.Struct], None]:
        """The outbox's put, logging how the request ended (with the parent's
        request id, so a worker log line can be matched to an access log line)."""
        rid = msg.request_id or "-"

        def emit(out: msgspec.Struct) -> None:
            if isinstance(out, p.Done):
                log.info("request %s: %s, %d prompt tokens (%d cached), %d generated, "
                         "prefill %.3f s, decode %.3f s", rid, out.finish_reason, out.prompt_tokens,
                         out.cached_tokens, out.completion_tokens, out.prefill_s, out.decode_s)
            elif isinstance(out, p.Error):
                log.warning("request %s: %s: %s", rid, out.code, out.message)
            self.outbox.put(out)

        return emit

    def _embed(self, msg: p.Embed) -> None:
        if not self.engine.opts.embedding:
            self.outbox.put(p.Error(msg.id, "not_embedding_model", "worker is not in embedding mode"))
            return
        try:
            vectors, count = self.engine.embed(msg.inputs)
        except Refused as exc:
            self.outbox.put(p.Error(msg.id, exc.code, str(exc)))
            return
        self.outbox.put(p.Embeddings(msg.id, vectors, count))

    def _start(self, req_id: int, work: Callable[[threading.Event], None]) -> None:
        # A request the parent sends right after another's Done (before our
        # done-callback ran) may briefly find every thread busy: it waits its turn.
        ev = threading.Event()
        self.cancels[req_id] = ev
        self.pending += 1
        fut = asyncio.get_running_loop().run_in_executor(self.executor, self._run_work, req_id, work, ev)
        fut.add_done_callback(lambda f: self._finished(req_id, f))

    def _run_work(self, req_id: int, work: Callable[[threading.Event], None], ev: threading.Event) -> None:
        self.active.add(req_id)
        try:
            work(ev)
        finally:
            self.active.discard(req_id)

    def _finished(self, req_id: int, fut: asyncio.Future[None]) -> None:
        self.cancels.pop(req_id, None)
        self.pending -= 1
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            # Reported to the parent as this request's terminal error.
            self.outbox.send(p.Error(req_id, "internal_error", f"{type(exc).__name__}: {exc}"))


def load_engine(name: str, opts: EngineOptions) -> EngineApi:
    """Import engine ``name`` and load the model into it (LoadError when either fails)."""
    return loader(name)(opts)


async def run(opts: EngineOptions, dial: Dial, heartbeat_s: float, engine_name: str) -> int:
    try:
        secret = read_secret()
    except HandshakeRefused as exc:
        log.error("%s", exc)
        return 1
    watch_stdin()
    reader, writer = await dial.open()
    try:
        await handshake(reader, writer, secret)
    except (HandshakeRefused, TimeoutError, ConnectionError) as exc:
        # Not our parent (or it went away): serve nothing on this connection.
        log.error("handshake with the parent failed: %s", exc or type(exc).__name__)
        writer.close()
        return 1
    codec = p.worker_codec()
    try:
        # Importing an engine and loading take seconds to minutes: off the
        # loop, so the connection stays serviced meanwhile.
        engine = await asyncio.to_thread(load_engine, engine_name, opts)
    except LoadError as exc:
        writer.write(codec.encode(p.LoadFailed(p.PROTOCOL_VERSION, str(exc))))
        await writer.drain()
        writer.close()
        return p.EXIT_LOAD_FAILED
    writer.write(codec.encode(p.Ready(engine.facts)))
    await writer.drain()
    try:
        code = await WorkerServer(engine, reader, writer, heartbeat_s).serve()
    finally:
        await asyncio.to_thread(engine.close)
    writer.close()
    return code
