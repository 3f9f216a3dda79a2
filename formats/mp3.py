"""An MP3's length from its frame headers, read without decoding it.

MPEG audio has no length in any header: the decoder (dr_mp3) reads frame
after frame, and each frame header says its sample rate, its bit rate and so
its length in bytes. :func:`mp3_seconds` walks those headers the same way,
skipping an ID3v2 tag at the start and resynchronising on bytes that are no
frame (an ID3v1 tag at the end, junk) as the decoder does.

The walk is bounded: each frame moves it forward by at least its header's
length, and a file with more than :data:`MAX_JUNK_STEPS` resynchronisations
is refused. A crafted header whose stated length hides smaller frames makes
the walk undercount, but never past what the bytes allow: the smallest frame
(8 kbit/s) holds 72 ms in 72 bytes, so a clip of ``n`` bytes lasts at most
``n / 1000`` seconds.
"""

from __future__ import annotations

# kbit/s for bit-rate indices 1..14: MPEG-1 layers I, II, III, then MPEG-2 and
# 2.5 layer I, and layers II and III (which share one table).
_V1 = {1: (32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352, 384, 416, 448),
       2: (32, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384),
       3: (32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320)}
_V2 = {1: (32, 48, 56, 64, 80, 96, 112, 128, 144, 160, 176, 192, 224, 256),
       2: (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
       3: (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160)}
# Sample rates by the header's version bits: 3 = MPEG-1, 2 = MPEG-2, 0 = MPEG-2.5.
_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}
MAX_JUNK_STEPS = 1 << 16


class Mp3Error(ValueError):
    """The bytes are no MP3 the length of which can be told."""


def _frame(data: bytes, pos: int) -> tuple[int, int, int] | None:
    """(length in bytes, samples, sample rate) of the frame header at ``pos``, or None."""
    if pos + 4 > len(data) or data[pos] != 0xFF or data[pos + 1] & 0xE0 != 0xE0:
        return None
    version, layer_bits = (data[pos + 1] >> 3) & 3, (data[pos + 1] >> 1) & 3
    bitrate_index, rate_index, padding = data[pos + 2] >> 4, (data[pos + 2] >> 2) & 3, (data[pos + 2] >> 1) & 1
    if version == 1 or layer_bits == 0 or bitrate_index == 15 or rate_index == 3:
        return None  # reserved values: no frame
    if bitrate_index == 0:
        raise Mp3Error("free-format MP3 (no bit rate in its frame headers) is not supported")
    layer = 4 - layer_bits
    rate = _RATES[version][rate_index]
    bitrate = (_V1 if version == 3 else _V2)[layer][bitrate_index - 1] * 1000
    if layer == 1:
        return (12 * bitrate // rate + padding) * 4, 384, rate
    samples = 1152 if layer == 2 or version == 3 else 576
    return samples // 8 * bitrate // rate + padding, samples, rate


def _id3_end(data: bytes) -> int:
    """Where the audio begins: after an ID3v2 tag (its size is 4 syncsafe bytes)."""
    if not data.startswith(b"ID3") or len(data) < 10:
        return 0
    size = (data[6] & 0x7F) << 21 | (data[7] & 0x7F) << 14 | (data[8] & 0x7F) << 7 | (data[9] & 0x7F)
    return 10 + size + (10 if data[5] & 0x10 else 0)  # a footer repeats the header


def mp3_seconds(data: bytes) -> tuple[float, int]:
    """(seconds, the highest sample rate) of the frames the headers describe."""
    pos = _id3_end(data)
    seconds, top_rate, frames, junk = 0.0, 0, 0, 0
    while pos < len(data):
        frame = _frame(data, pos)
        if frame is None:
            junk += 1
            if junk > MAX_JUNK_STEPS:
                raise Mp3Error(f"the MP3 has more than {MAX_JUNK_STEPS} stretches of bytes that are no frame")
            found = data.find(b"\xff", pos + 1)
            if found < 0:
                break
            pos = found
            continue
        length, samples, rate = frame
        seconds += samples / rate
        top_rate = max(top_rate, rate)
        frames += 1
        pos += max(length, 4)
    if not frames:
        raise Mp3Error("the MP3 has no frame")
    return seconds, top_rate
