"""Checks on a request's audio clips before they reach the engine.

The engine decodes WAV, MP3 and FLAC itself (miniaudio: mixing to mono and
resampling whatever rate the file has to the encoder's 16 kHz), into one
buffer of 32-bit samples that it sizes from the decoder's stated length
before it reads any audio. So a clip is judged from its header:

- Too short: a clip that comes out as a single sample trips an assertion
  that aborts the whole process (measured with xllamacpp 2026.10: a 1-sample
  WAV, a 2-frame 48 kHz WAV, a 1-sample FLAC), so a WAV or FLAC shorter than
  :data:`MIN_AUDIO_S` is refused. An MP3 frame holds 1,152 samples, so any
  decodable MP3 is long enough.
- Too long: the length decides the buffer, 64 kB a second at 16 kHz, and
  the spectrogram after it. A 45 kB 8-bit WAV at 1 Hz is 12.5 hours, 7 GB
  and minutes of work before the engine says the prompt is too long; a FLAC
  whose STREAMINFO claims 1.5e9 samples is a 6 GB buffer. A clip may last
  :data:`MAX_AUDIO_S` (30 minutes: as long as the longest-listening audio
  models take, about 115 MB decoded), a request's clips together
  :data:`MAX_REQUEST_AUDIO_S`. A WAV's length counts the data present (the
  engine reads no more, whatever the data chunk claims: measured), FLAC's
  the total STREAMINFO states (the buffer's size), an MP3's its frames
  (formats/mp3.py).
- Sample rates outside :data:`MIN_RATE`..:data:`MAX_RATE` (8 kHz telephone
  audio to 192 kHz studio audio) are refused: no recording has them, and a
  rate of 1 Hz turns every byte into a second of audio.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from formats.mp3 import Mp3Error, mp3_seconds

# Shorter clips carry nothing a model could hear, and the shortest crash the
# engine: refused with a clear error instead.
MIN_AUDIO_S = 0.05
MAX_AUDIO_S = 30 * 60.0
MAX_REQUEST_AUDIO_S = 60 * 60.0
MIN_RATE, MAX_RATE = 8_000, 192_000

FORMATS = ("wav", "mp3", "flac")


class AudioError(Exception):
    """A clip the engine must not see; the message says why."""


class AudioTooLong(AudioError):
    """A clip (or a request's clips) longer than the limit."""


@dataclass(frozen=True)
class Clip:
    kind: str  # wav, mp3 or flac
    seconds: float  # as long as the engine will decode it
    rate: int  # the file's sample rate (Hz)


def audio_format(data: bytes) -> str | None:
    """``wav``, ``mp3`` or ``flac`` from the magic bytes, else None."""
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "wav"
    if data.startswith(b"fLaC"):
        return "flac"
    if data.startswith(b"ID3") or (len(data) >= 2 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return "mp3"
    return None


def _wav(data: bytes) -> tuple[float, float, int]:
    """(seconds, at most seconds, rate) from the fmt and data chunks, counting
    the data actually present. The upper bound counts by the bits per sample,
    as packed formats (4-bit ADPCM) hold more samples than whole bytes."""
    rate = channels = bits = 0
    pos = 12
    while pos + 8 <= len(data):
        kind, size = data[pos:pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        body = pos + 8
        if kind == b"fmt " and size >= 16 and body + 16 <= len(data):
            channels, rate = (int(v) for v in struct.unpack_from("<HI", data, body + 2))
            bits = struct.unpack_from("<H", data, body + 14)[0]
        elif kind == b"data":
            if not rate or not channels:
                raise AudioError("the WAV file has no format chunk before its data")
            present = min(size, len(data) - body)
            frame_bytes = channels * max(1, (bits + 7) // 8)
            frame_bits = channels * max(1, bits)
            return present // frame_bytes / rate, present * 8 // frame_bits / rate, rate
        pos = body + size + (size & 1)  # chunks are padded to even sizes
    raise AudioError("the WAV file has no data chunk")


def _flac(data: bytes) -> tuple[float, int]:
    """(seconds, rate) from STREAMINFO, the first metadata block."""
    if len(data) < 8 + 34 or data[4] & 0x7F != 0:
        raise AudioError("the FLAC file does not start with its STREAMINFO block")
    info = data[8:8 + 34]
    packed = int.from_bytes(info[10:18], "big")  # rate:20 channels:3 bits:5 samples:36
    rate = packed >> 44
    samples = packed & ((1 << 36) - 1)
    if not rate or not samples:
        raise AudioError("the FLAC file does not say its length (total samples 0)")
    return samples / rate, rate


def _measure(kind: str, data: bytes) -> tuple[float | None, float, int]:
    """(seconds for the minimum, None if any decodable clip is long enough;
    seconds for the maximum; the sample rate)."""
    if kind == "wav":
        return _wav(data)
    if kind == "flac":
        seconds, rate = _flac(data)
        return seconds, seconds, rate
    try:
        seconds, rate = mp3_seconds(data)
    except Mp3Error as exc:
        raise AudioError(str(exc)) from exc
    return None, seconds, rate


def check_clip(data: bytes, declared: str | None = None) -> Clip:
    """The clip's format and length, or :class:`AudioError` when it must not
    reach the engine (:class:`AudioTooLong` over the length limit)."""
    kind = audio_format(data)
    if kind is None:
        raise AudioError("the audio is not a WAV, MP3 or FLAC file")
    if declared is not None and declared != kind:
        raise AudioError(f"the audio is {kind.upper()}, not {declared.upper()} as its format says")
    shortest, longest, rate = _measure(kind, data)
    if not MIN_RATE <= rate <= MAX_RATE:
        raise AudioError(f"the clip's sample rate is {rate} Hz; {MIN_RATE} to {MAX_RATE} Hz are taken")
    if shortest is not None and shortest < MIN_AUDIO_S:
        raise AudioError(f"the clip lasts {shortest * 1000:.1f} ms; at least {MIN_AUDIO_S * 1000:.0f} ms")
    if longest > MAX_AUDIO_S:
        raise AudioTooLong(f"the clip lasts {longest:.0f} s; at most {MAX_AUDIO_S:.0f} s per clip")
    return Clip(kind, longest, rate)


def check_audio(data: bytes, declared: str | None = None) -> str:
    """The clip's format, or :class:`AudioError` when it must not reach the engine."""
    return check_clip(data, declared).kind


def check_request_seconds(total: float) -> None:
    """:class:`AudioTooLong` when a request's clips last more than MAX_REQUEST_AUDIO_S."""
    if total > MAX_REQUEST_AUDIO_S:
        raise AudioTooLong(f"the request's clips last {total:.0f} s; at most {MAX_REQUEST_AUDIO_S:.0f} s "
                           "in one request")
