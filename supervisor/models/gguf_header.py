"""The GGUF header reader: fixed header, key/value section and tensor index.

It walks a memory-mapped file and stops there: tensor data is never touched,
so even a 100 GB model is read in a few milliseconds. Large arrays (the
tokenizer's tokens, scores and merges) are skipped by length; only their item
count is kept. Of the tensor index only each tensor's (name, data bytes) is
kept. A truncated or corrupt file raises :class:`GgufError` with a reason the
library shows next to the model.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path
from typing import Any

GGUF_MAGIC = b"GGUF"
# Arrays longer than this are skipped (tokenizer data), only counted.
_MAX_DECODED_ARRAY = 8192
_MAX_KV_COUNT = 1_000_000
# Real models have a few thousand tensors; a larger count is a corrupt header
# (and would cost seconds to walk).
_MAX_TENSORS = 100_000
_MAX_TENSOR_DIMS = 8  # ggml itself has 4
_DEFAULT_ALIGNMENT = 32

# GGUF value types: (struct format, byte size) for the fixed-size ones.
_SCALARS: dict[int, tuple[str, int]] = {
    0: ("<B", 1),
    1: ("<b", 1),
    2: ("<H", 2),
    3: ("<h", 2),
    4: ("<I", 4),
    5: ("<i", 4),
    6: ("<f", 4),
    7: ("<?", 1),
    10: ("<Q", 8),
    11: ("<q", 8),
    12: ("<d", 8),
}
_STRING = 8
_U64 = struct.Struct("<Q")
_ARRAY = 9


class GgufError(Exception):
    """The file is not a readable GGUF; ``reason`` says why in a few words."""

    def __init__(self, path: Path | str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = str(path)
        self.reason = reason



class _Cursor:
    """Bounds-checked little-endian reads over a buffer."""

    def __init__(self, buf: mmap.mmap | bytes, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.size = len(buf)
        self.path = path

    def _need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise GgufError(
                self.path, f"truncated header: {what} at byte {self.pos} runs past the end"
            )

    def scalar(self, vtype: int, what: str) -> Any:
        fmt, size = _SCALARS[vtype]
        self._need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def u32(self, what: str) -> int:
        return int(self.scalar(4, what))

    def u64(self, what: str) -> int:
        return int(self.scalar(10, what))

    def string(self, what: str) -> str:
        n = self.u64(what)
        self._need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise GgufError(self.path, f"invalid UTF-8 in {what}") from exc

    def skip(self, n: int, what: str) -> None:
        self._need(n, what)
        self.pos += n

    def skip_strings(self, count: int, what: str) -> None:
        # A tight loop: tokenizer arrays hold a few hundred thousand strings.
        unpack, buf, pos, end = _U64.unpack_from, self.buf, self.pos, self.size - 8
        for _ in range(count):
            if pos > end:
                break
            pos += 8 + unpack(buf, pos)[0]
        else:
            if pos <= self.size:
                self.pos = pos
                return
        self.pos = min(pos, self.size)
        raise GgufError(self.path, f"truncated header: {what} runs past the end")


def _read_value(cur: _Cursor, vtype: int, key: str, counts: dict[str, int]) -> Any:
    if vtype in _SCALARS:
        return cur.scalar(vtype, key)
    if vtype == _STRING:
        return cur.string(key)
    if vtype != _ARRAY:
        raise GgufError(cur.path, f"unknown value type {vtype} for key {key!r}")
    item_type = cur.u32(key)
    count = cur.u64(key)
    counts[key] = count
    if count > cur.size:
        raise GgufError(cur.path, f"array {key!r} claims {count} items, more than the file holds")
    if item_type in _SCALARS:
        fmt, size = _SCALARS[item_type]
        cur._need(count * size, key)
        if count > _MAX_DECODED_ARRAY:
            cur.pos += count * size
            return None
        values = list(struct.unpack_from(f"<{count}{fmt[1]}", cur.buf, cur.pos))
        cur.pos += count * size
        return values
    if item_type == _STRING:
        if count > _MAX_DECODED_ARRAY:
            cur.skip_strings(count, key)
            return None
        return [cur.string(key) for _ in range(count)]
    raise GgufError(cur.path, f"unsupported array item type {item_type} for key {key!r}")


def read_gguf_kv(path: Path) -> tuple[int, int, dict[str, Any], dict[str, int]]:
    """(version, tensor_count, key -> value, array key -> item count).

    Arrays longer than a few thousand items map to None (only counted).
    """
    version, tensor_count, kv, counts, _ = read_header(path, tensors=False)
    return version, tensor_count, kv, counts


Parsed = tuple[int, int, dict[str, Any], dict[str, int], list[tuple[str, int]]]


def read_header(path: Path, *, tensors: bool) -> Parsed:
    """The header, and with ``tensors`` the (name, data bytes) of each tensor."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise GgufError(path, f"file is too short to be GGUF ({size} bytes)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                cur = _Cursor(mm, path)
                version, tensor_count, kv, counts = _parse(cur)
                spans = _tensor_spans(cur, tensor_count, _alignment(cur, kv)) if tensors else []
                return version, tensor_count, kv, counts, spans
    except OSError as exc:
        raise GgufError(path, f"cannot read file: {exc.strerror or exc}") from exc


def read_tensor_dims(path: Path, wanted: frozenset[str]) -> tuple[dict[str, Any], dict[str, list[int]]]:
    """The header's keys, and the dims (``ne0`` first) of the tensors named in ``wanted``.

    The index is walked only until every wanted tensor was seen; sizes and
    data are never looked at.
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise GgufError(path, f"file is too short to be GGUF ({size} bytes)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                cur = _Cursor(mm, path)
                _, count, kv, _ = _parse(cur)
                return kv, _dims_of(cur, count, wanted)
    except OSError as exc:
        raise GgufError(path, f"cannot read file: {exc.strerror or exc}") from exc


def _dims_of(cur: _Cursor, count: int, wanted: frozenset[str]) -> dict[str, list[int]]:
    if count > _MAX_TENSORS:
        raise GgufError(cur.path, f"implausible tensor count {count}")
    dims: dict[str, list[int]] = {}
    for _ in range(count):
        if len(dims) == len(wanted):
            break
        name = cur.string("tensor name")
        n_dims = cur.u32(f"tensor {name!r}")
        if n_dims > _MAX_TENSOR_DIMS:
            raise GgufError(cur.path, f"tensor {name!r} claims {n_dims} dimensions")
        if name in wanted:
            dims[name] = [cur.u64(f"tensor {name!r}") for _ in range(n_dims)]
            cur.skip(12, f"tensor {name!r}")  # type and data offset
        else:
            cur.skip(8 * n_dims + 12, f"tensor {name!r}")
    return dims


def _parse(cur: _Cursor) -> tuple[int, int, dict[str, Any], dict[str, int]]:
    if bytes(cur.buf[0:4]) != GGUF_MAGIC:
        raise GgufError(cur.path, "not a GGUF file (bad magic)")
    cur.pos = 4
    version = cur.u32("version")
    if version not in (2, 3):
        raise GgufError(cur.path, f"unsupported GGUF version {version}")
    tensor_count = cur.u64("tensor count")
    kv_count = cur.u64("key/value count")
    if kv_count > _MAX_KV_COUNT:
        raise GgufError(cur.path, f"implausible key/value count {kv_count}")
    kv: dict[str, Any] = {}
    counts: dict[str, int] = {}
    for _ in range(kv_count):
        key = cur.string("key")
        vtype = cur.u32(key)
        kv[key] = _read_value(cur, vtype, key, counts)
    return version, tensor_count, kv, counts


def _alignment(cur: _Cursor, kv: dict[str, Any]) -> int:
    value = kv.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(value, int) or value <= 0 or value & (value - 1):
        raise GgufError(cur.path, f"general.alignment {value!r} is not a power of two")
    return value


def _tensor_spans(cur: _Cursor, count: int, alignment: int) -> list[tuple[str, int]]:
    """(name, bytes) of each tensor's data, from the tensor index after the keys.

    Sizes come from the gaps between data offsets (alignment padding
    included), so tensor types unknown to this reader cost nothing.
    """
    if count > _MAX_TENSORS:
        raise GgufError(cur.path, f"implausible tensor count {count}")
    index: list[tuple[int, str]] = []
    for _ in range(count):
        name = cur.string("tensor name")
        n_dims = cur.u32(f"tensor {name!r}")
        if n_dims > _MAX_TENSOR_DIMS:
            raise GgufError(cur.path, f"tensor {name!r} claims {n_dims} dimensions")
        cur.skip(8 * n_dims + 4, f"tensor {name!r}")  # shape and type
        index.append((cur.u64(f"tensor {name!r}"), name))
    data_size = cur.size - -(-cur.pos // alignment) * alignment
    index.sort()
    spans: list[tuple[str, int]] = []
    for i, (offset, name) in enumerate(index):
        end = index[i + 1][0] if i + 1 < len(index) else data_size
        if end > data_size or offset > data_size:
            raise GgufError(cur.path, f"truncated: the data of tensor {name!r} runs past the end")
        spans.append((name, end - offset))
    return spans
