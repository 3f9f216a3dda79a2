"""Property tests of the two byte-stream readers the parent trusts least.

The worker IPC (``read_frame`` + ``Codec.decode``) and the job NDJSON reader
(``EventFramer``) get random bytes and valid streams corrupted at random: the
IPC side may only raise :class:`worker.protocol.ProtocolError` subclasses, the
event reader never raises at all (bad lines become ``log`` events).
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import msgspec
import pytest

hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobs.events import JobEvent, Log, event_type, make_event
from supervisor.lab.job_process import EventFramer
from worker import protocol as p

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
EVENT_TYPES = {"started", "log", "stage", "progress", "metric", "done", "failed"}

text = st.text(max_size=40)
ints = st.integers(min_value=-(2**63), max_value=2**63 - 1)
small = st.integers(min_value=0, max_value=2**31)
floats = st.floats(allow_nan=False, allow_infinity=False, width=32)
json_values = st.recursive(
    st.none() | st.booleans() | ints | floats | text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=12,
)
stats = st.builds(p.WorkerStats, busy=st.booleans(), requests_done=small, requests_cancelled=small,
                  tokens_generated=small, active_id=st.none() | small)

to_worker = st.one_of(
    st.builds(
        p.Generate, id=ints,
        params=st.builds(p.SamplingParams, max_tokens=st.none() | small, temperature=floats,
                         seed=st.none() | ints, stop=st.lists(text, max_size=3)),
        messages=st.none() | st.lists(st.builds(p.ChatMessage, role=text, content=st.none() | text), max_size=3),
        prompt=st.none() | text,
        tools=st.none() | st.lists(st.dictionaries(text, json_values, max_size=3), max_size=2),
        template_vars=st.dictionaries(text, json_values, max_size=2),
        request_id=text,
    ),
    st.builds(p.Tokenize, id=ints, text=text, add_special=st.booleans()),
    st.builds(p.Embed, id=ints, inputs=st.lists(text, max_size=3)),
    st.builds(p.Cancel, id=ints),
    st.builds(p.Ping, seq=ints),
    st.just(p.Shutdown()),
)
from_worker = st.one_of(
    st.builds(p.Hello, protocol_version=small, pid=small, nonce=st.binary(min_size=32, max_size=32),
              proof=st.binary(max_size=64)),
    st.builds(p.Ready,
              facts=st.builds(p.ModelFacts, path=text, n_ctx=small, n_ctx_train=small, n_vocab=small,
                              has_chat_template=st.booleans(), embedding=st.booleans(),
                              chat_template=st.none() | text)),
    st.builds(p.LoadFailed, protocol_version=small, reason=text),
    st.builds(p.Delta, id=ints, text=text, n_tokens=small),
    st.builds(p.Done, id=ints, finish_reason=st.sampled_from(["stop", "length", "cancelled"]),
              prompt_tokens=small, completion_tokens=small, cached_tokens=small,
              prefill_s=floats, decode_s=floats),
    st.builds(p.Error, id=ints, code=text, message=text),
    st.builds(p.Tokens, id=ints, tokens=st.lists(ints, max_size=8)),
    st.builds(p.Embeddings, id=ints, vectors=st.lists(st.lists(floats, max_size=4), max_size=3),
              prompt_tokens=small),
    st.builds(p.Pong, seq=ints, stats=stats),
    st.builds(p.Heartbeat, stats=stats),
)


# ---------------------------------------------------------------- worker IPC


class Outcome(msgspec.Struct):
    messages: list[Any]
    clean_eof: bool
    error: p.ProtocolError | None = None


async def _read_all(data: bytes, codec: p.Codec, max_frame: int) -> Outcome:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    out = Outcome([], False)
    try:
        while (body := await p.read_frame(reader, max_frame)) is not None:
            out.messages.append(codec.decode(body))
        out.clean_eof = True
    except p.ProtocolError as exc:  # the only exceptions allowed out
        out.error = exc
    return out


def read_all(data: bytes, codec: p.Codec, max_frame: int = p.MAX_FRAME) -> Outcome:
    return asyncio.run(_read_all(data, codec, max_frame))


def frames(codec: p.Codec, messages: list[msgspec.Struct]) -> bytes:
    return b"".join(codec.encode(m) for m in messages)


@FUZZ
@given(st.lists(to_worker, max_size=5))
def test_valid_frames_round_trip_to_worker(messages: list[msgspec.Struct]) -> None:
    out = read_all(frames(p.parent_codec(), messages), p.worker_codec())
    assert out.error is None and out.clean_eof
    assert out.messages == messages


@FUZZ
@given(st.lists(from_worker, max_size=5))
def test_valid_frames_round_trip_from_worker(messages: list[msgspec.Struct]) -> None:
    out = read_all(frames(p.worker_codec(), messages), p.parent_codec())
    assert out.error is None and out.clean_eof
    assert out.messages == messages


@FUZZ
@given(st.binary(max_size=2048), st.booleans())
def test_random_bytes_raise_only_protocol_errors(data: bytes, parent_side: bool) -> None:
    codec = p.parent_codec() if parent_side else p.worker_codec()
    out = read_all(data, codec, max_frame=4096)
    assert out.clean_eof or isinstance(out.error, (p.FrameTooLarge, p.TruncatedFrame, p.InvalidMessage))


@FUZZ
@given(st.binary(max_size=512), st.booleans())
def test_random_bodies_in_valid_frames_decode_or_are_invalid(body: bytes, parent_side: bool) -> None:
    data = struct.pack(">I", len(body)) + body
    out = read_all(data, p.parent_codec() if parent_side else p.worker_codec())
    if out.error is not None:
        assert isinstance(out.error, p.InvalidMessage)
    else:
        assert len(out.messages) == 1


@st.composite
def corrupted(draw: st.DrawFn) -> tuple[bytes, list[msgspec.Struct], str]:
    messages = draw(st.lists(from_worker, min_size=1, max_size=4))
    data = bytearray(frames(p.worker_codec(), messages))
    how = draw(st.sampled_from(["flip", "truncate", "insert", "length", "splice"]))
    at = draw(st.integers(min_value=0, max_value=len(data) - 1))
    if how == "flip":
        data[at] ^= draw(st.integers(min_value=1, max_value=255))
    elif how == "truncate":
        del data[at:]
    elif how == "insert":
        data[at:at] = draw(st.binary(min_size=1, max_size=16))
    elif how == "length":
        data[0:4] = struct.pack(">I", draw(st.integers(min_value=0, max_value=2**32 - 1)))
    else:  # a valid frame of the other direction where one of ours belongs
        data[at:at] = p.parent_codec().encode(draw(to_worker))
    return bytes(data), messages, how


@FUZZ
@given(corrupted())
def test_corrupted_streams_raise_only_protocol_errors(case: tuple[bytes, list[msgspec.Struct], str]) -> None:
    data, messages, how = case
    out = read_all(data, p.parent_codec())
    assert out.clean_eof or isinstance(out.error, p.ProtocolError)
    if how == "truncate":
        # Only whole frames come out: a prefix of what was sent, then a clean
        # EOF exactly at a frame boundary, else TruncatedFrame.
        assert out.messages == messages[: len(out.messages)]
        assert out.clean_eof or isinstance(out.error, p.TruncatedFrame)


@FUZZ
@given(st.integers(min_value=65, max_value=2**32 - 1))
def test_oversize_header_is_refused_before_the_body(length: int) -> None:
    # No body follows: refusing must not wait for (or allocate) it.
    out = read_all(struct.pack(">I", length), p.parent_codec(), max_frame=64)
    assert isinstance(out.error, p.FrameTooLarge)


def test_deeply_nested_message_is_invalid_not_a_crash() -> None:
    nested = b"\x91" * 100_000 + b"\xc0"
    body = (b"\x83" + msgspec.msgpack.encode("type") + msgspec.msgpack.encode("Generate")
            + msgspec.msgpack.encode("id") + b"\x01" + msgspec.msgpack.encode("template_vars")
            + b"\x81" + msgspec.msgpack.encode("k") + nested)
    with pytest.raises(p.InvalidMessage):
        p.worker_codec().decode(body)


# ---------------------------------------------------------------- job NDJSON events


events = st.builds(make_event, st.sampled_from(sorted(EVENT_TYPES)),
                   st.dictionaries(text, json_values, max_size=4))


def pair(e: JobEvent) -> tuple[str, dict[str, Any]]:
    return event_type(e), e.data


def feed_all(framer: EventFramer, chunks: list[bytes]) -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    for chunk in chunks:
        out += [pair(e) for e in framer.feed(chunk).events]
    out += [pair(e) for e in framer.finish().events]
    return out


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


@FUZZ
@given(st.lists(st.binary(max_size=300), max_size=10))
def test_random_stdout_never_raises(chunks: list[bytes]) -> None:
    for ev_type, data in feed_all(EventFramer(max_line_bytes=256), chunks):
        assert ev_type in EVENT_TYPES
        assert isinstance(data, dict)


@FUZZ
@given(st.lists(events, max_size=8), st.lists(st.integers(min_value=0), max_size=12))
def test_events_survive_any_chunking(evs: list[JobEvent], cuts: list[int]) -> None:
    data = b"".join(msgspec.json.encode(e) + b"\n" for e in evs)
    got = feed_all(EventFramer(), split(data, cuts))
    assert got == [pair(e) for e in evs]


@FUZZ
@given(st.lists(st.one_of(events, st.binary(max_size=80).map(lambda b: b.replace(b"\n", b""))), max_size=10),
       st.lists(st.integers(min_value=0), max_size=12))
def test_garbage_lines_do_not_disturb_valid_ones(lines: list[JobEvent | bytes], cuts: list[int]) -> None:
    encoded = [x if isinstance(x, bytes) else msgspec.json.encode(x) for x in lines]
    got = feed_all(EventFramer(), split(b"".join(e + b"\n" for e in encoded), cuts))
    valid = [pair(x) for x in lines if not isinstance(x, bytes)]
    # Each garbage line is at most one warning; valid events keep their order.
    assert [g for g in got if g in valid] == valid
    assert len(got) <= len(lines)
    for ev_type, data in got:
        if (ev_type, data) not in valid:
            assert ev_type == "log" or isinstance(data, dict)


@FUZZ
@given(st.integers(min_value=65, max_value=2000), events, st.lists(st.integers(min_value=0), max_size=6))
def test_overlong_line_is_dropped_and_the_next_one_kept(size: int, ev: JobEvent, cuts: list[int]) -> None:
    data = b"x" * size + b"\n" + msgspec.json.encode(ev) + b"\n"
    framer = EventFramer(max_line_bytes=64)
    got = feed_all(framer, split(data, cuts))
    encoded_len = len(msgspec.json.encode(ev))
    if encoded_len <= 64:
        assert got[-1] == pair(ev)
    assert got[0][0] == "log"


def test_deeply_nested_event_is_a_warning() -> None:
    line = b'{"type":"log","data":{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}}\n"
    got = EventFramer(max_line_bytes=1 << 20).feed(line).events
    assert len(got) == 1 and isinstance(got[0], Log) and "malformed" in got[0].data["message"]
