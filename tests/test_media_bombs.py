"""Decompression bombs: images and clips whose headers claim far more than
their bytes hold are refused from those headers, before any decoding, with a
400 naming the part; the worker checks the same again. Measured: the
worker's peak RSS (VmHWM) and the time each refusal takes stay bounded.

Without these checks (red team, round 3): a 43-byte GIF canvas of 23170 x
23170 took a worker to 3.16 GB, a 141-byte JPEG frame of 26700 x 26700 to
4.18 GB, a 45 kB 8-bit WAV at 1 Hz to 7.3 GB and 276 s, and a 2 kB FLAC
claiming 1.5e9 samples was killed for memory.
"""

from __future__ import annotations

import base64
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from formats.audio import (
    MAX_AUDIO_S,
    MAX_RATE,
    MIN_RATE,
    AudioError,
    AudioTooLong,
    check_clip,
)
from formats.image_headers import MAX_BLOCKS, ImageRefused, ImageSize, ImageTooLarge
from formats.images import MAX_IMAGE_PIXELS, check_image, image_size
from formats.mp3 import mp3_seconds
from tests.server import Server, running, short_tempdir
from tests.tiny_audio import wav, write_tiny_audio_pair
from tests.tiny_vision import gif, png, write_tiny_vision_pair
from tests.worker_harness import spawn_worker
from worker import protocol as p

pytestmark = pytest.mark.timeout(240)

# Coarse bounds: with the checks the worker never decodes a bomb (its peak
# grows by what serving a tiny image costs); without them the smallest bomb
# here costs it 370 MB.
WORKER_PEAK_GROWTH_MIB = 64
PARENT_PEAK_GROWTH_MIB = 96
REFUSAL_S = 5.0


def peak_rss_mib(pid: int) -> float:
    """A process's peak resident set (VmHWM), from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for pid {pid}")


# ------------------------------------------------------------------ bombs


def gif_bomb(width: int, height: int, frame: tuple[int, int, int, int] = (0, 0, 1, 1)) -> bytes:
    """A GIF whose logical screen is ``width`` x ``height``, holding one small
    frame (x, y, w, h) of one pixel's data: 35 bytes."""
    screen = struct.pack("<HHBBB", width, height, 0x00, 0, 0)  # no global colour table
    image = b"," + struct.pack("<HHHHB", *frame, 0x80)  # a local table of two colours
    lzw = bytes([2, 2, 0x4C, 0x01, 0])  # minimum code size 2; clear, index 0, end
    return b"GIF89a" + screen + image + b"\x00\x00\x00\xff\xff\xff" + lzw + b";"


def _segment(marker: int, body: bytes) -> bytes:
    return bytes([0xFF, marker]) + struct.pack(">H", len(body) + 2) + body


def jpeg_bomb(width: int, height: int, before_frame: bytes = b"") -> bytes:
    """A baseline greyscale JPEG whose frame header says ``width`` x ``height``
    and whose scan holds no data (decoders fill it with one DC code): 136 bytes."""
    tables = _segment(0xDB, b"\x00" + bytes([1] * 64))
    frame = _segment(0xC0, struct.pack(">BHHB", 8, height, width, 1) + b"\x01\x11\x00")
    huffman = _segment(0xC4, b"\x00" + bytes([1] + [0] * 15) + b"\x00" + b"\x10" + bytes([1] + [0] * 15) + b"\x00")
    scan = _segment(0xDA, b"\x01\x01\x00\x00\x3f\x00")
    return b"\xff\xd8" + before_frame + tables + frame + huffman + scan + b"\xff\xd9"


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_bomb(width: int, height: int, inflated: int | None = None) -> bytes:
    """An 8-bit greyscale PNG whose IDAT inflates to ``inflated`` zero bytes
    (by default just what ``width`` x ``height`` needs)."""
    need = height * (1 + width) if inflated is None else inflated
    deflate = zlib.compressobj(9)
    block = bytes(1 << 20)
    parts = [deflate.compress(block[:min(len(block), need - done)]) for done in range(0, need, len(block))]
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    idat = b"".join(parts) + deflate.flush()
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def interlaced_png(width: int, height: int, colour: int, depth: int) -> bytes:
    """An Adam7-interlaced PNG of zeros, holding exactly the data its passes need."""
    bits = {0: 1, 2: 3, 4: 2, 6: 4}[colour] * depth
    passes = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
    raw = 0
    for x, y, dx, dy in passes:
        w, h = max(0, (width - x + dx - 1) // dx), max(0, (height - y + dy - 1) // dy)
        raw += h * (1 + (w * bits + 7) // 8) if w and h else 0
    ihdr = struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, 1)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(bytes(raw)))
            + _chunk(b"IEND", b""))


def wav_clip(rate: int, n_bytes: int, bits: int = 8) -> bytes:
    """A mono PCM WAV of ``n_bytes`` of samples at ``rate`` Hz."""
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * bits // 8, max(1, bits // 8), bits)
    body = b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", n_bytes)
    body += bytes([128]) * n_bytes
    return b"RIFF" + struct.pack("<I", len(body)) + body


def flac_claim(rate: int, samples: int) -> bytes:
    """A FLAC whose STREAMINFO claims ``samples`` at ``rate`` Hz (mono, 16-bit), and no frames."""
    packed = (rate << 44) | (15 << 36) | samples
    info = struct.pack(">HH", 4096, 4096) + bytes(6) + packed.to_bytes(8, "big") + bytes(16)
    return b"fLaC" + bytes([0x80]) + len(info).to_bytes(3, "big") + info + bytes(2000)


def mp3_silence(seconds: float) -> bytes:
    """MPEG-2.5 layer III frames at 8 kbit/s, 8 kHz, mono, without CRC: 72
    bytes and 72 ms each, silent (the engine decodes them)."""
    frame = bytes([0xFF, 0xE3, 0x18, 0xC0]) + bytes(68)
    return frame * round(seconds / 0.072)


# ------------------------------------------------------------------ headers


def test_header_readers_read_what_the_decoder_allocates() -> None:
    assert check_image(png(40, 24, seed=3)) == ImageSize(40, 24)
    assert check_image(gif(13, 7, (1, 2, 3))) == ImageSize(13, 7)
    assert check_image(jpeg_bomb(100, 50)) == ImageSize(100, 50)
    # The bombs, by their headers alone.
    for bomb, size in [(gif_bomb(23170, 23170), (23170, 23170)), (jpeg_bomb(26700, 26700), (26700, 26700)),
                       (png_bomb(18900, 18900, inflated=1000), (18900, 18900))]:
        with pytest.raises(ImageTooLarge, match=f"{size[0]}x{size[1]}"):
            check_image(bomb)
    # A GIF frame beyond its screen grows the canvas a lenient decoder allocates.
    with pytest.raises(ImageTooLarge, match="20000x3000"):
        check_image(gif_bomb(10, 10, frame=(19000, 2000, 1000, 1000)))
    # JPEG: APP segments, fill bytes and padding before the frame header are walked.
    padded = b"\xff\xe0" + struct.pack(">H", 18) + bytes(16) + b"\x00\x00" + b"\xff\xff\xff"
    assert check_image(jpeg_bomb(300, 200, before_frame=padded)) == ImageSize(300, 200)
    # A PNG whose data inflates past what its IHDR implies (stb_image would keep it all);
    # its header alone is fine.
    assert image_size(png_bomb(1, 1, inflated=64 << 20)) == ImageSize(1, 1)
    with pytest.raises(ImageTooLarge, match="inflates"):
        check_image(png_bomb(1, 1, inflated=64 << 20))
    assert check_image(png_bomb(64, 64)) == ImageSize(64, 64)


@pytest.mark.parametrize("data, why", [
    (b"\x89PNG\r\n\x1a\n" + _chunk(b"IDAT", b"x"), "IHDR"),
    (b"GIF89a\x01", "truncated"),
    (jpeg_bomb(0, 50), "no height or width"),
    (b"\xff\xd8\xff\xda\x00\x02", "no frame header"),
    (b"GIF89a" + bytes(7) + b"\x21\xf9" + b"\x01\x00" * (MAX_BLOCKS + 1), "more than"),
])
def test_malformed_headers_are_refused(data: bytes, why: str) -> None:
    with pytest.raises(ImageRefused, match=why):
        check_image(data)


_MAGIC = st.sampled_from([b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF89a", b"RIFF\x00\x00\x00\x00WAVE",
                          b"fLaC", b"ID3", b"\xff\xfb"])


@settings(max_examples=400, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(_MAGIC, st.binary(max_size=600))
def test_any_bytes_get_a_typed_refusal_or_a_bounded_size(magic: bytes, rest: bytes) -> None:
    data = magic + rest
    try:
        size = check_image(data)
        assert size.pixels <= MAX_IMAGE_PIXELS
    except ImageRefused:
        pass  # a typed refusal, with its reason
    try:
        clip = check_clip(data)
        assert clip.seconds <= MAX_AUDIO_S and MIN_RATE <= clip.rate <= MAX_RATE
    except AudioError:
        pass


def test_worst_case_walks_stay_fast() -> None:
    """4 MiB of the costliest bytes for each walk (the largest item a request carries)."""
    worst = [b"\xff\xd8" + b"\xff" * (4 << 20), b"\xff\xd8\xff" + b"\x00\xff" * (2 << 20),
             b"GIF89a" + bytes(7) + b"\x21\xf9" + b"\x01\x00" * (2 << 20), b"\xff\xfb" + b"\xff" * (4 << 20)]
    for data in worst:
        start = time.perf_counter()
        with pytest.raises((ImageRefused, AudioError)):
            check_image(data) if not data.startswith(b"\xff\xfb") else check_clip(data)
        assert time.perf_counter() - start < 1.0
    start = time.perf_counter()
    assert mp3_seconds(mp3_silence(4000)[: 4 << 20])[0] > 4000
    assert time.perf_counter() - start < 1.0


def test_clip_lengths_and_rates_come_from_the_headers() -> None:
    assert check_clip(wav(1.0, 440.0)).seconds == 1.0
    with pytest.raises(AudioError, match="1 Hz"):
        check_clip(wav_clip(1, 45_000))  # 12.5 hours at 1 Hz
    with pytest.raises(AudioError, match="384000 Hz"):
        check_clip(wav_clip(384_000, 48_000))
    with pytest.raises(AudioTooLong, match="93750 s"):
        check_clip(flac_claim(16_000, 1_500_000_000))
    with pytest.raises(AudioError, match="1 Hz"):
        check_clip(flac_claim(1, 100))
    assert check_clip(flac_claim(16_000, 16_000)).seconds == 1.0
    # Packed samples (1 bit each) count as many as the bits allow.
    with pytest.raises(AudioTooLong):
        check_clip(wav_clip(8_000, 2 << 20, bits=1))
    assert round(check_clip(mp3_silence(10.0)).seconds) == 10
    with pytest.raises(AudioTooLong, match="at most 1800 s"):
        check_clip(mp3_silence(MAX_AUDIO_S + 60))


# ------------------------------------------------------------------ the worker's own check


def _one(kind: str) -> list[p.ChatMessage]:
    return [p.ChatMessage("user", parts=[p.TextPart(f"{kind}: "), p.ImagePart(), p.TextPart(" what?")])]


async def test_the_worker_refuses_bombs_itself(tmp_path: Path) -> None:
    """Bombs sent to a worker directly, past the parent's checks."""
    model, mmproj = write_tiny_vision_pair(tmp_path)
    async with spawn_worker(model, "--mmproj", str(mmproj), n_ctx=2048) as (w, _):
        before = peak_rss_mib(w.proc.pid)
        for bomb in (gif_bomb(8000, 8000), jpeg_bomb(8000, 8000), png_bomb(1, 1, inflated=64 << 20)):
            _, end = await w.generate(messages=_one("look"), images=[bomb])
            assert isinstance(end, p.Error) and end.code == "image_too_large", end
        three = [p.ChatMessage("user", parts=[p.TextPart("a "), p.ImagePart(), p.ImagePart(), p.ImagePart(),
                                              p.TextPart(" b")])]
        _, end = await w.generate(messages=three, images=[gif_bomb(6000, 6000)] * 3)
        assert isinstance(end, p.Error) and end.code == "image_too_large" and "100 MP" in end.message, end
        # The limits refuse nothing the decoder takes: interlaced PNGs with just their data decode.
        for image in (png(32, 32, (255, 0, 0)), interlaced_png(13, 7, 2, 8), interlaced_png(9, 17, 6, 16)):
            _, end = await w.generate(messages=_one("look"), images=[image])
            assert isinstance(end, p.Done), end
        assert peak_rss_mib(w.proc.pid) - before < WORKER_PEAK_GROWTH_MIB


async def test_the_audio_worker_refuses_long_clips_itself(tmp_path: Path) -> None:
    model, mmproj = write_tiny_audio_pair(tmp_path)
    async with spawn_worker(model, "--mmproj", str(mmproj), n_ctx=2048) as (w, _):
        before = peak_rss_mib(w.proc.pid)
        for clip in (flac_claim(16_000, 50_000_000), wav_clip(1, 2000)):
            _, end = await w.generate(messages=_one("listen"), images=[clip])
            assert isinstance(end, p.Error) and end.code == "invalid_audio", end
        assert peak_rss_mib(w.proc.pid) - before < WORKER_PEAK_GROWTH_MIB


# ------------------------------------------------------------------ through the API

VISION, AUDIO = "vl/tiny-vl", "audio/tiny-audio"


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    models = short_tempdir("gvb")
    (models / "vl").mkdir()
    (models / "audio").mkdir()
    write_tiny_vision_pair(models / "vl")
    write_tiny_audio_pair(models / "audio")
    with running(Server(models, state_dir=short_tempdir(), model=VISION,
                        env={"GPUVISOR_N_CTX": "2048", "GPUVISOR_MAX_BODY_BYTES": str(48 << 20)})) as s:
        yield s


def _image(data: bytes) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


def _clip(data: bytes, fmt: str) -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def _post(srv: Server, model: str, parts: list[dict[str, Any]]) -> tuple[httpx.Response, float]:
    body = {"model": model, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "what: "}, *parts,
                                                      {"type": "text", "text": " ?"}]}]}
    start = time.monotonic()
    r = httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=120)
    return r, time.monotonic() - start


def _worker_pid(srv: Server, model: str) -> int:
    r, _ = _post(srv, model, [])  # loads the model
    assert r.status_code == 200, r.text
    return int(srv.worker(model)["pid"])


def _refused(srv: Server, model: str, parts: list[dict[str, Any]], param: str, code: str) -> str:
    r, took = _post(srv, model, parts)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, code), err
    assert took < REFUSAL_S, took
    return str(err["message"])


def test_image_bombs_are_refused_by_the_parent(srv: Server) -> None:
    pid = _worker_pid(srv, VISION)
    assert srv.proc is not None
    worker_before, parent_before = peak_rss_mib(pid), peak_rss_mib(srv.proc.pid)
    # Just over the per-image limit first (cheapest to a worker that would decode it).
    _refused(srv, VISION, [_image(gif_bomb(8000, 8000))], "messages[0].content[1]", "image_too_large")
    # The bombs.
    message = _refused(srv, VISION, [_image(gif_bomb(23170, 23170))], "messages[0].content[1]", "image_too_large")
    assert "23170x23170" in message and "50 MP" in message
    _refused(srv, VISION, [_image(jpeg_bomb(26700, 26700))], "messages[0].content[1]", "image_too_large")
    _refused(srv, VISION, [_image(png_bomb(18900, 18900, inflated=1 << 20))], "messages[0].content[1]",
             "image_too_large")
    _refused(srv, VISION, [_image(png(8, 8, (0, 0, 0))), _image(png_bomb(1, 1, inflated=64 << 20))],
             "messages[0].content[2]", "image_too_large")
    # Per request: three of 36 MP are each allowed, together over 100 MP; the third is named.
    message = _refused(srv, VISION, [_image(gif_bomb(6000, 6000))] * 3, "messages[0].content[3]",
                       "image_too_large")
    assert "100 MP in one request" in message
    # Eight of the GIFs in one request: refused at the first.
    _refused(srv, VISION, [_image(gif_bomb(23170, 23170))] * 8, "messages[0].content[1]", "image_too_large")
    r, _ = _post(srv, VISION, [_image(png(32, 32, (255, 0, 0)))])
    assert r.status_code == 200, r.text
    assert srv.worker(VISION)["pid"] == pid  # no crash
    assert peak_rss_mib(pid) - worker_before < WORKER_PEAK_GROWTH_MIB
    assert peak_rss_mib(srv.proc.pid) - parent_before < PARENT_PEAK_GROWTH_MIB


def test_audio_bombs_are_refused_by_the_parent(srv: Server) -> None:
    pid = _worker_pid(srv, AUDIO)
    before = peak_rss_mib(pid)
    # A FLAC at 1 Hz first (cheapest to a worker that would decode it: 100 s).
    message = _refused(srv, AUDIO, [_clip(flac_claim(1, 100), "flac")], "messages[0].content[1]", "invalid_audio")
    assert "1 Hz" in message and "8000 to 192000 Hz" in message
    _refused(srv, AUDIO, [_clip(wav_clip(1, 45_000), "wav")], "messages[0].content[1]", "invalid_audio")
    message = _refused(srv, AUDIO, [_clip(flac_claim(16_000, 1_500_000_000), "flac")], "messages[0].content[1]",
                       "audio_too_long")
    assert "93750 s" in message
    _refused(srv, AUDIO, [_clip(mp3_silence(MAX_AUDIO_S + 60), "mp3")], "messages[0].content[1]",
             "audio_too_long")
    # Per request: three clips of 25 minutes each are allowed alone, not together.
    long = _clip(flac_claim(16_000, 25 * 60 * 16_000), "flac")
    message = _refused(srv, AUDIO, [long, long, long], "messages[0].content[3]", "audio_too_long")
    assert "in one request" in message
    r, _ = _post(srv, AUDIO, [_clip(wav(1.0, 440.0), "wav")])
    assert r.status_code == 200, r.text
    assert srv.worker(AUDIO)["pid"] == pid
    assert peak_rss_mib(pid) - before < WORKER_PEAK_GROWTH_MIB


def test_responses_api_refuses_bombs_naming_its_part(srv: Server) -> None:
    body = {"model": VISION, "max_output_tokens": 2, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what: "},
        {"type": "input_image", "image_url": _image(gif_bomb(8000, 8000))["image_url"]["url"]}]}]}
    r = httpx.post(srv.base_url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == ("input[0].content[1]", "image_too_large")

