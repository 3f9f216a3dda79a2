"""A real model-worker process for tests: started with ``python -m worker``,
connected over a Unix socket as the parent would, and spoken to with the IPC
protocol (worker/protocol.py)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

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
    ``args``, connected, and its first message (Hello or LoadFailed);
    killed when the block ends if it is still running."""
    sock = short_tempdir() / "w.sock"
    conn: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = (
        asyncio.get_running_loop().create_future())
    server = await asyncio.start_unix_server(lambda r, w: conn.set_result((r, w)), path=str(sock))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "worker", "--socket", str(sock), "--model", str(model),
        "--n-ctx", str(n_ctx), "--threads", "1", "--n-gpu-layers", "0", *args,
        stdin=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, cwd=REPO)
    try:
        reader, writer = await asyncio.wait_for(conn, 60)
        worker = Worker(proc, reader, writer)
        yield worker, await worker.next_msg()
    finally:
        server.close()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@asynccontextmanager
async def spawn_worker(model: Path, *args: str, n_ctx: int = 512) -> AsyncIterator[tuple[Worker, p.Hello]]:
    """A worker on ``model`` (1 thread, CPU only) with further ``args``, and
    its Hello; asked to stop (exit 0) when the block ends."""
    async with start_worker(model, *args, n_ctx=n_ctx) as (worker, hello):
        assert isinstance(hello, p.Hello), hello
        yield worker, hello
        worker.writer.write(worker.codec.encode(p.Shutdown()))
        assert await asyncio.wait_for(worker.proc.wait(), 30) == 0
