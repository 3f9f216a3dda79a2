"""An image's pixel dimensions from its header, read without decoding it.

A decoder allocates its pixel buffers from the header's dimensions before it
reads any image data, so a few dozen bytes can claim a 23,000 x 23,000
canvas (2 GB of RGBA) and the decoder allocates and fills it. These readers
take the dimensions a decoder would allocate for:

- PNG: the IHDR chunk (after any Apple ``CgBI`` chunks, which the engine's
  decoder, stb_image, accepts before it). Its image data is also inflated
  here, bounded, to check that it holds no more than IHDR implies: stb_image
  grows its buffer for whatever the zlib stream yields, so a 1x1 PNG whose
  4 MB of IDAT inflates to 4 GB costs 4 GB (measured: 512 MB of IDAT cost a
  worker 520 MB).
- GIF: the logical screen and every frame descriptor (a decoder that sizes
  its canvas to fit the frames allocates their extent).
- JPEG: every SOF0..SOF15 frame header before the first scan, found by a
  bounded walk over the marker segments (the frame header must precede the
  scans; a decoder fails on a later one).

Every walk is bounded by the data's length and by a count of blocks, and
each step moves forward, so a crafted file costs its reader linear time.
"""

from __future__ import annotations

import re
import struct
import zlib
from dataclasses import dataclass


class ImageRefused(Exception):
    """An image the engine's decoders must not see; the message says why."""


class ImageTooLarge(ImageRefused):
    """An image whose dimensions (or decoded data) are over a limit."""


@dataclass(frozen=True)
class ImageSize:
    width: int
    height: int

    @property
    def pixels(self) -> int:
        return self.width * self.height


# Walks stop (and refuse the file) beyond these many blocks: well above what
# any encoder writes into the largest image a request may carry (4 MiB of
# 255-byte GIF sub-blocks is 16,500 of them), far below a crafted file's
# millions of one-byte blocks.
MAX_BLOCKS = 1 << 17
# Output per inflate step while checking PNG data: memory stays at this.
_INFLATE_STEP = 1 << 20


# ------------------------------------------------------------------ PNG


@dataclass(frozen=True)
class _PngHeader:
    width: int
    height: int
    depth: int
    colour: int
    interlaced: bool
    iphone: bool  # Apple's CgBI PNG: raw deflate, no zlib wrapper


_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}


def _png_chunks(data: bytes) -> list[tuple[bytes, int, int]]:
    """(type, start of its data, length) of each chunk, up to IEND."""
    chunks: list[tuple[bytes, int, int]] = []
    pos = 8
    while pos + 8 <= len(data):
        if len(chunks) >= MAX_BLOCKS:
            raise ImageRefused(f"the PNG has more than {MAX_BLOCKS} chunks")
        length, kind = struct.unpack_from(">I4s", data, pos)
        if pos + 12 + length > len(data):
            raise ImageRefused(f"the PNG is truncated inside its {kind.decode('latin-1')!r} chunk")
        chunks.append((kind, pos + 8, length))
        if kind == b"IEND":
            break
        pos += 12 + length
    return chunks


def _png_header(chunks: list[tuple[bytes, int, int]], data: bytes) -> _PngHeader:
    iphone = False
    for kind, start, length in chunks:
        if kind == b"CgBI":
            iphone = True
            continue
        if kind != b"IHDR" or length != 13:
            raise ImageRefused("the PNG does not begin with its IHDR chunk")
        width, height, depth, colour, _, _, interlace = struct.unpack_from(">IIBBBBB", data, start)
        if colour not in _PNG_CHANNELS or depth not in (1, 2, 4, 8, 16):
            raise ImageRefused(f"the PNG has an invalid colour type {colour} or bit depth {depth}")
        return _PngHeader(width, height, depth, colour, interlace == 1, iphone)
    raise ImageRefused("the PNG has no IHDR chunk")


def _png_raw_bytes(h: _PngHeader) -> int:
    """What the image data inflates to: each row's filter byte and its pixels,
    for each of Adam7's seven passes when interlaced."""
    bits = _PNG_CHANNELS[h.colour] * h.depth

    def rows(w: int, n: int) -> int:
        return 0 if w == 0 or n == 0 else n * (1 + (w * bits + 7) // 8)

    if not h.interlaced:
        return rows(h.width, h.height)
    passes = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
    return sum(rows((h.width - x + dx - 1) // dx, (h.height - y + dy - 1) // dy) for x, y, dx, dy in passes)


def _check_png_data(chunks: list[tuple[bytes, int, int]], data: bytes, h: _PngHeader) -> None:
    """Inflate the IDAT stream in bounded steps; refuse it past what IHDR implies."""
    limit = _png_raw_bytes(h)
    inflater = zlib.decompressobj(-15 if h.iphone else 15)
    total = 0
    try:
        for kind, start, length in chunks:
            if kind != b"IDAT":
                continue
            pending = data[start:start + length]
            while pending and not inflater.eof:
                total += len(inflater.decompress(pending, _INFLATE_STEP))
                if total > limit:
                    raise ImageTooLarge(f"the PNG's image data inflates to more than the {limit} bytes "
                                        f"its {h.width}x{h.height} header implies")
                pending = inflater.unconsumed_tail
    except zlib.error as exc:
        raise ImageRefused(f"the PNG's image data is not a valid zlib stream: {exc}") from exc


def png_size(data: bytes) -> ImageSize:
    """The PNG's dimensions from IHDR."""
    header = _png_header(_png_chunks(data), data)
    return ImageSize(header.width, header.height)


def check_png_data(data: bytes) -> None:
    """Refuse a PNG whose image data inflates to more than its IHDR implies
    (memory stays bounded: the output is counted, not kept)."""
    chunks = _png_chunks(data)
    _check_png_data(chunks, data, _png_header(chunks, data))


# ------------------------------------------------------------------ GIF


def _skip_sub_blocks(data: bytes, pos: int) -> tuple[int, int]:
    """(the position after a chain of data sub-blocks, how many it had); a
    zero length ends the chain."""
    count = 0
    while pos < len(data):
        size = data[pos]
        pos += 1 + size
        count += 1
        if size == 0:
            return pos, count
        if count > MAX_BLOCKS:
            raise ImageRefused(f"the GIF has more than {MAX_BLOCKS} data blocks")
    raise ImageRefused("the GIF is truncated inside a data block")


def gif_size(data: bytes) -> ImageSize:
    """The canvas a decoder allocates: the logical screen, grown to hold every frame."""
    if len(data) < 13:
        raise ImageRefused("the GIF is truncated in its header")
    width, height, flags = struct.unpack_from("<HHB", data, 6)
    pos = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    blocks = 0
    while pos < len(data) and data[pos] != 0x3B:  # 0x3B: the trailer
        block = data[pos]
        if block == 0x21:  # an extension: its label, then sub-blocks
            pos, count = _skip_sub_blocks(data, pos + 2)
        elif block == 0x2C:  # a frame: its descriptor, local table, LZW size, sub-blocks
            if pos + 10 > len(data):
                raise ImageRefused("the GIF is truncated in a frame descriptor")
            x, y, w, h, frame_flags = struct.unpack_from("<HHHHB", data, pos + 1)
            width, height = max(width, x + w), max(height, y + h)
            pos += 10 + (3 << ((frame_flags & 7) + 1) if frame_flags & 0x80 else 0) + 1
            pos, count = _skip_sub_blocks(data, pos)
        else:
            raise ImageRefused(f"the GIF has an unknown block 0x{block:02x}")
        blocks += count
        if blocks > MAX_BLOCKS:
            raise ImageRefused(f"the GIF has more than {MAX_BLOCKS} data blocks")
    return ImageSize(width, height)


# ------------------------------------------------------------------ JPEG

# Start-of-frame markers: 0xC0..0xCF but DHT (C4), JPG (C8) and DAC (CC).
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# Markers without a length: TEM, RST0..7, SOI.
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8), 0xD8})
_SOS, _EOI = 0xDA, 0xD9
# A marker's 0xFF and any fill bytes before it, skipped at C speed.
_FILL = re.compile(rb"\xff+")


def jpeg_size(data: bytes) -> ImageSize:
    """The largest frame any SOF before the first scan declares."""
    found: list[ImageSize] = []
    pos = 2
    for _ in range(MAX_BLOCKS):
        fill = _FILL.match(data, pos)
        if fill is None:
            # Padding between segments: decoders scan ahead to the next marker.
            pos = data.find(b"\xff", pos)
            if pos < 0:
                break
            continue
        pos = fill.end()
        if pos >= len(data):
            break
        marker = data[pos]
        pos += 1
        if marker in _STANDALONE or marker == 0x00:
            continue
        if marker in (_SOS, _EOI):
            break
        if pos + 2 > len(data):
            break
        length = struct.unpack_from(">H", data, pos)[0]
        if length < 2:
            raise ImageRefused(f"the JPEG has a segment of length {length}")
        if marker in _SOF:
            if length < 8 or pos + 7 > len(data):
                raise ImageRefused("the JPEG's frame header is truncated")
            height, width = struct.unpack_from(">HH", data, pos + 3)
            if height == 0 or width == 0:
                # Height 0 defers it to a DNL marker after the first scan: unknown here.
                raise ImageRefused("the JPEG's frame header states no height or width")
            found.append(ImageSize(width, height))
        pos += length
    else:
        raise ImageRefused(f"the JPEG has more than {MAX_BLOCKS} segments before its image data")
    if not found:
        raise ImageRefused("the JPEG has no frame header (SOF) before its image data")
    return max(found, key=lambda s: s.pixels)
