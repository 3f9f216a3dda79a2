"""A real model-worker process for tests: started with ``python -m worker``,
given its secret and let in over a Unix socket by the parent's own listener
(supervisor/workers/connection.py), and spoken to with the IPC protocol
(worker/protocol.py)."""

from __future__ import annotations

import asyncio
import secrets
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from supervisor.workers.connection import Endpoint, Listener
from tests.server import REPO, short_tempdir
from worker import protocol as p

GREEDY = p.SamplingParams(max_tokens=12, temperature=0.0, top_k=1, ignore_eos=True)


class Worker:
    def __init__(self, proc: asyncio.subprocess.Process, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.proc = proc
        self.reader = reader
        self.writer = writer
        self.codec = p.parent_codec()
        self.next_id = 1

    async def next_msg(self) -> p.FromWorker:
        while True:
            body = await asyncio.wait_for(p.read_frame(self.reader), 60)
            assert body is not None, "the worker closed the connection"
            msg = self.codec.decode(body)
            if not isinstance(msg, p.Heartbeat):
                return msg  # type: ignore[no-any-return]

    async def generate(self, **fields: object) -> tuple[str, p.Done | p.Error]:
        """Run one Generate; the text it streamed and its terminal message."""
        req_id = self.next_id
        self.next_id += 1
        fields.setdefault("params", GREEDY)
        self.writer.write(self.codec.encode(p.Generate(req_id, **fields)))  # type: ignore[arg-type]
        text = ""
        while True:
            msg = await self.next_msg()
            assert getattr(msg, "id", req_id) == req_id
            if isinstance(msg, p.Delta):
                text += msg.text
            elif isinstance(msg, (p.Done, p.Error)):
                return text, msg


@asynccontextmanager
async def start_worker(model: Path, *args: str, n_ctx: int = 512) -> AsyncIterator[tuple[Worker, p.FromWorker]]:
    """A worker process on ``model`` (1 thread, CPU only) with further
    ``args``, connected, and its first message once proven (Ready or LoadFailed);
    killed when the block ends if it is still running."""
    secret = secrets.token_bytes(p.SECRET_BYTES)
    listener = Listener(Endpoint(), secret, str(model))
    await listener.open(short_tempdir() / "w.sock")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "worker", *listener.address, "--model", str(model),
        "--n-ctx", str(n_ctx), "--threads", "1", "--n-gpu-layers", "0", *args,
        stdin=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, cwd=REPO)
    assert proc.stdin is not None
    proc.stdin.write(p.secret_line(secret))
    try:
        conn = await asyncio.wait_for(listener.proven, 60)
        listener.close()
        worker = Worker(proc, conn.reader, conn.writer)
        yield worker, await worker.next_msg()
    finally:
        listener.close()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@asynccontextmanager
async def spawn_worker(model: Path, *args: str, n_ctx: int = 512) -> AsyncIterator[tuple[Worker, p.Ready]]:
    """A worker on ``model`` (1 thread, CPU only) with further ``args``, and
    its Ready; asked to stop (exit 0) when the block ends."""
    async with start_worker(model, *args, n_ctx=n_ctx) as (worker, hello):
        assert isinstance(hello, p.Ready), hello
        yield worker, hello
        worker.writer.write(worker.codec.encode(p.Shutdown()))
        assert await asyncio.wait_for(worker.proc.wait(), 30) == 0
