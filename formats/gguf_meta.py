"""Scalar and string keys of a GGUF header, read without loading the model.

The engine reports a built-in fallback as the chat template of a model that
has none, so whether a model carries its own template is read here, from the
file. Arrays (the tokenizer's hundreds of thousands of strings) are skipped,
not decoded.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
MAX_KEYS = 1 << 20


class GGUFMetaError(ValueError):
    pass


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> int | float | bool:
        try:
            (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        except struct.error as exc:
            raise GGUFMetaError("truncated GGUF header") from exc
        self.pos += struct.calcsize("<" + fmt)
        return value  # type: ignore[no-any-return]

    def string(self) -> str:
        n = int(self.unpack("Q"))
        if self.pos + n > len(self.buf):
            raise GGUFMetaError("truncated GGUF string")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", "replace")

    def skip_string(self) -> None:
        n = int(self.unpack("Q"))  # read before pos is taken: unpack moves it
        self.pos += n

    def value(self, vtype: int) -> str | int | float | bool | None:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            self._skip_array()
            return None
        raise GGUFMetaError(f"unknown GGUF value type {vtype}")

    def _skip_array(self) -> None:
        item, count = int(self.unpack("I")), int(self.unpack("Q"))
        if item in _SCALARS:
            self.pos += count * struct.calcsize("<" + _SCALARS[item])
        elif item == _STRING:
            for _ in range(count):
                self.skip_string()
        else:
            for _ in range(count):
                self.value(item)
        if self.pos > len(self.buf):
            raise GGUFMetaError("truncated GGUF array")


def read_metadata(path: Path) -> dict[str, str | int | float | bool]:
    """Every non-array key of the header."""
    return _read(path)[0]


def read_header(path: Path) -> tuple[dict[str, str | int | float | bool], set[str]]:
    """Every non-array key of the header, and the names of all its keys."""
    return _read(path)


def _read(path: Path) -> tuple[dict[str, str | int | float | bool], set[str]]:
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(buf)
        if buf[:4] != b"GGUF":
            raise GGUFMetaError(f"{path.name} is not a GGUF file")
        cur.pos = 4
        version = int(cur.unpack("I"))
        if version < 2:
            raise GGUFMetaError(f"GGUF version {version} is not supported")
        cur.unpack("Q")  # tensor count
        n_kv = int(cur.unpack("Q"))
        if n_kv > MAX_KEYS:
            raise GGUFMetaError(f"GGUF header claims {n_kv} keys")
        out: dict[str, str | int | float | bool] = {}
        names: set[str] = set()
        for _ in range(n_kv):
            key = cur.string()
            names.add(key)
            value = cur.value(int(cur.unpack("I")))
            if value is not None:
                out[key] = value
        return out, names
