"""LoRA adapters in a real worker process: one that fits is held and applied
per request; one the engine refuses costs only itself, never the worker."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

pytest.importorskip("peft", reason="needs the train extra")

from jobs.hf_convert import convert
from jobs.lora_export import convert_adapter
from tests.lora_support import random_adapter
from tests.server import REPO, short_tempdir
from tests.tiny_hf import build_tiny_model
from worker import protocol as p

pytestmark = pytest.mark.timeout(180)
GREEDY = p.SamplingParams(max_tokens=12, temperature=0.0, top_k=1, ignore_eos=True)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("lora-worker")
    hf = build_tiny_model(tmp / "tiny-hf")
    convert(hf, tmp / "base.gguf", "F16", "tiny-hf")
    convert_adapter(random_adapter(hf, tmp / "good", seed=1), hf, tmp / "good.gguf", "F16", "good")
    other = build_tiny_model(tmp / "other", intermediate_size=96)
    convert_adapter(random_adapter(other, tmp / "bad", seed=2), other, tmp / "bad.gguf", "F16", "bad")
    return {"base": tmp / "base.gguf", "good": tmp / "good.gguf", "bad": tmp / "bad.gguf"}


class _Worker:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.codec = p.parent_codec()
        self.next_id = 1

    async def next_msg(self) -> p.FromWorker:
        while True:
            body = await asyncio.wait_for(p.read_frame(self.reader), 60)
            assert body is not None, "the worker closed the connection"
            msg = self.codec.decode(body)
            if not isinstance(msg, p.Heartbeat):
                return msg  # type: ignore[no-any-return]

    async def generate(self, adapter: str = "", scale: float = 1.0) -> tuple[str, p.Done | p.Error]:
        req_id, self.next_id = self.next_id, self.next_id + 1
        self.writer.write(self.codec.encode(p.Generate(req_id, GREEDY, prompt="user What colour",
                                                       adapter=adapter, adapter_scale=scale)))
        text = ""
        while True:
            msg = await self.next_msg()
            if isinstance(msg, p.Delta):
                text += msg.text
            elif isinstance(msg, (p.Done, p.Error)):
                return text, msg


@asynccontextmanager
async def _spawn(model: Path, adapters: list[Path]) -> AsyncIterator[tuple[_Worker, p.Hello]]:
    sock = short_tempdir() / "w.sock"
    conn: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = (
        asyncio.get_running_loop().create_future())
    server = await asyncio.start_unix_server(lambda r, w: conn.set_result((r, w)), path=str(sock))
    args = [a for path in adapters for a in ("--lora", str(path))]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "worker", "--socket", str(sock), "--model", str(model), "--n-ctx", "256",
        "--threads", "1", "--n-gpu-layers", "0", "--parallel", "2", *args,
        stdin=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, cwd=REPO)
    try:
        worker = _Worker(*await asyncio.wait_for(conn, 60))
        hello = await worker.next_msg()
        assert isinstance(hello, p.Hello), hello
        yield worker, hello
        worker.writer.write(worker.codec.encode(p.Shutdown()))
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        server.close()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_held_adapter_applies_per_request(files: dict[str, Path]) -> None:
    async with _spawn(files["base"], []) as (plain, _):
        base_text, _ = await plain.generate()
    async with _spawn(files["base"], [files["good"]]) as (worker, hello):
        assert hello.facts.adapters == [str(files["good"])] and not hello.facts.adapter_error
        with_adapter, done = await worker.generate(str(files["good"]))
        assert isinstance(done, p.Done) and with_adapter != base_text
        assert (await worker.generate())[0] == base_text
        assert (await worker.generate(str(files["good"]), 0.0))[0] == base_text
        _, unknown = await worker.generate(str(files["bad"]))
        assert isinstance(unknown, p.Error) and unknown.code == "adapter_unavailable"


async def test_an_adapter_the_engine_refuses_leaves_the_base_serving(files: dict[str, Path]) -> None:
    async with _spawn(files["base"], []) as (plain, _):
        base_text, _ = await plain.generate()
    async with _spawn(files["base"], [files["bad"]]) as (worker, hello):
        assert hello.facts.adapters == [] and hello.facts.adapter_error
        text, done = await worker.generate()
        assert isinstance(done, p.Done) and text == base_text
        _, refused = await worker.generate(str(files["bad"]))
        assert isinstance(refused, p.Error) and refused.code == "adapter_unavailable"
