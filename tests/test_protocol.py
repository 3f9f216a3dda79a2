"""IPC framing and decoding, and a real worker answering bad frames cleanly."""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path

import msgspec
import pytest

from tests.worker_harness import start_worker
from worker import protocol as p

ALL_TO_WORKER = [
    p.Generate(1, p.SamplingParams(max_tokens=5, stop=["x"], json_object=True),
               messages=[p.ChatMessage("user", "hi")], tools=[{"type": "function"}],
               template_vars={"enable_thinking": False}, request_id="r1"),
    p.Generate(2, prompt="once upon"),
    p.Tokenize(3, "hello", add_special=False),
    p.Embed(4, ["a", "b"]),
    p.Cancel(5),
    p.Ping(6),
    p.Shutdown(),
]
STATS = p.WorkerStats(True, 1, 2, 3, 4)
ALL_FROM_WORKER = [
    p.Hello(p.PROTOCOL_VERSION, 123, b"n" * p.NONCE_BYTES, b"proof"),
    p.Ready(p.ModelFacts("/m.gguf", 512, 2048, 300, True, False, "{{x}}")),
    p.LoadFailed(p.PROTOCOL_VERSION, "bad file"),
    p.Started(1, 12),
    p.Delta(1, "héllo", 2),
    p.Done(1, "length", 10, 5, 3, 0.1, 0.2),
    p.Error(1, "context_length_exceeded", "too long"),
    p.Tokens(3, [1, 2, 3]),
    p.Embeddings(4, [[0.5, 0.25]], 7),
    p.Pong(6, STATS),
    p.Heartbeat(STATS),
]


def _reader(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    r = asyncio.StreamReader()
    r.feed_data(data)
    if eof:
        r.feed_eof()
    return r


@pytest.mark.parametrize("msg", ALL_TO_WORKER, ids=lambda m: type(m).__name__)
async def test_round_trip_to_worker(msg: msgspec.Struct) -> None:
    frame = p.parent_codec().encode(msg)
    body = await p.read_frame(_reader(frame))
    assert body is not None
    assert p.worker_codec().decode(body) == msg


@pytest.mark.parametrize("msg", ALL_FROM_WORKER, ids=lambda m: type(m).__name__)
async def test_round_trip_from_worker(msg: msgspec.Struct) -> None:
    frame = p.worker_codec().encode(msg)
    body = await p.read_frame(_reader(frame))
    assert body is not None
    assert p.parent_codec().decode(body) == msg


async def test_clean_eof_is_none_and_truncation_is_an_error() -> None:
    assert await p.read_frame(_reader(b"")) is None
    frame = p.parent_codec().encode(p.Ping(1))
    with pytest.raises(p.TruncatedFrame):
        await p.read_frame(_reader(frame[:2]))
    with pytest.raises(p.TruncatedFrame):
        await p.read_frame(_reader(frame[:-1]))


async def test_oversize_frame_is_refused_before_reading_it() -> None:
    header = struct.pack(">I", p.MAX_FRAME + 1)
    with pytest.raises(p.FrameTooLarge):
        # No body follows and no EOF is fed: a reader that tried to read it would hang.
        await asyncio.wait_for(p.read_frame(_reader(header, eof=False)), 2)


def test_garbage_and_invalid_messages_raise_invalid_message() -> None:
    codec = p.worker_codec()
    with pytest.raises(p.InvalidMessage):
        codec.decode(b"\xc1\xff\x00garbage")
    with pytest.raises(p.InvalidMessage):
        codec.decode(msgspec.msgpack.encode({"type": "Generate", "id": "not-an-int"}))
    with pytest.raises(p.InvalidMessage):
        codec.decode(msgspec.msgpack.encode({"type": "NoSuchMessage"}))


async def test_real_worker_answers_bad_frames_with_errors(tiny_model_path: Path) -> None:
    """Garbage and invalid frames get Error(-1) replies; the connection stays usable."""
    async with start_worker(tiny_model_path, n_ctx=256) as (w, ready):
        assert isinstance(ready, p.Ready)
        assert ready.facts.n_ctx == 256 and ready.facts.has_chat_template
        garbage = b"\xc1\xc1\xc1"
        w.writer.write(struct.pack(">I", len(garbage)) + garbage)
        invalid = msgspec.msgpack.encode({"type": "Generate", "id": "x"})
        w.writer.write(struct.pack(">I", len(invalid)) + invalid)
        w.writer.write(w.codec.encode(p.Ping(7)))
        replies = [await w.next_msg() for _ in range(3)]
        assert [type(r).__name__ for r in replies] == ["Error", "Error", "Pong"]
        assert all(r.id == -1 for r in replies[:2])  # type: ignore[union-attr]
        assert replies[2].seq == 7  # type: ignore[union-attr]
        w.writer.write(w.codec.encode(p.Shutdown()))
        assert await asyncio.wait_for(w.proc.wait(), 30) == 0


async def test_worker_exits_3_on_a_bad_model_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 10)
    async with start_worker(bad) as (w, first):
        assert isinstance(first, p.LoadFailed) and "bad.gguf" in first.reason
        assert await asyncio.wait_for(w.proc.wait(), 30) == 3


class _Sink:
    """A StreamWriter stand-in that keeps what was written."""

    def __init__(self) -> None:
        self.data = b""

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        self.data += data


async def test_a_reply_too_large_to_send_ends_its_request_with_an_error() -> None:
    from worker.server import Outbox

    sink = _Sink()
    outbox = Outbox(asyncio.get_running_loop(), sink, coalesce_s=0)  # type: ignore[arg-type]
    huge = p.Embeddings(7, [[0.5] * 1024] * 2100, 1)  # about 19 MiB of msgpack floats
    outbox.put(huge)
    outbox.put(p.Pong(1, p.WorkerStats(False, 0, 0, 0)))
    for _ in range(10):
        await asyncio.sleep(0)
        if sink.data:
            break
    reader = asyncio.StreamReader()
    reader.feed_data(sink.data)
    reader.feed_eof()
    codec = p.parent_codec()
    replies = []
    while (body := await p.read_frame(reader)) is not None:
        replies.append(codec.decode(body))
    assert [type(r).__name__ for r in replies] == ["Error", "Pong"]
    assert replies[0].id == 7 and replies[0].code == "reply_too_large"
