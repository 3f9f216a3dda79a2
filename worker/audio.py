"""Checks on a request's audio clips before they reach the engine.

The engine decodes WAV, MP3 and FLAC itself (mixing to mono, resampling to
16 kHz). A clip that comes out as a single sample trips an assertion that
aborts the whole process (measured with xllamacpp 2026.10: a 1-sample WAV,
a 2-frame 48 kHz WAV, a 1-sample FLAC), so a WAV or FLAC shorter than
:data:`MIN_AUDIO_S` is refused here, from its header. An MP3 frame holds
1,152 samples, so any decodable MP3 is long enough.
"""

from __future__ import annotations

import struct

# Shorter clips carry nothing a model could hear, and the shortest crash the
# engine: refused with a clear error instead.
MIN_AUDIO_S = 0.05

FORMATS = ("wav", "mp3", "flac")


class AudioError(Exception):
    """A clip the engine must not see; the message says why."""


def audio_format(data: bytes) -> str | None:
    """``wav``, ``mp3`` or ``flac`` from the magic bytes, else None."""
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "wav"
    if data.startswith(b"fLaC"):
        return "flac"
    if data.startswith(b"ID3") or (len(data) >= 2 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return "mp3"
    return None


def _wav_seconds(data: bytes) -> float:
    """The clip's length from its fmt and data chunks (the data actually present)."""
    rate = frame_bytes = 0
    pos = 12
    while pos + 8 <= len(data):
        kind, size = data[pos:pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        body = pos + 8
        if kind == b"fmt " and size >= 16 and body + 16 <= len(data):
            channels, rate = (int(v) for v in struct.unpack_from("<HI", data, body + 2))
            bits = struct.unpack_from("<H", data, body + 14)[0]
            frame_bytes = channels * max(1, (bits + 7) // 8)
        elif kind == b"data":
            if not rate or not frame_bytes:
                raise AudioError("the WAV file has no format chunk before its data")
            present = min(size, len(data) - body)
            return float(present // frame_bytes / rate)
        pos = body + size + (size & 1)  # chunks are padded to even sizes
    raise AudioError("the WAV file has no data chunk")


def _flac_seconds(data: bytes) -> float:
    """The clip's length from STREAMINFO, the first metadata block."""
    if len(data) < 8 + 34 or data[4] & 0x7F != 0:
        raise AudioError("the FLAC file does not start with its STREAMINFO block")
    info = data[8:8 + 34]
    packed = int.from_bytes(info[10:18], "big")  # rate:20 channels:3 bits:5 samples:36
    rate = packed >> 44
    samples = packed & ((1 << 36) - 1)
    if not rate or not samples:
        raise AudioError("the FLAC file does not say its length (total samples 0)")
    return samples / rate


def check_audio(data: bytes, declared: str | None = None) -> str:
    """The clip's format, or :class:`AudioError` when it must not reach the engine."""
    kind = audio_format(data)
    if kind is None:
        raise AudioError("the audio is not a WAV, MP3 or FLAC file")
    if declared is not None and declared != kind:
        raise AudioError(f"the audio is {kind.upper()}, not {declared.upper()} as its format says")
    seconds = _wav_seconds(data) if kind == "wav" else _flac_seconds(data) if kind == "flac" else None
    if seconds is not None and seconds < MIN_AUDIO_S:
        raise AudioError(f"the clip lasts {seconds * 1000:.1f} ms; at least {MIN_AUDIO_S * 1000:.0f} ms")
    return kind
