"""Whether two GGUF models share a vocabulary, read from their headers.

A draft model must tokenize exactly as its target does. The check mirrors
the engine's own (which runs again when it loads the draft): the same
tokenizer model and special token ids, token counts within a small slack
(padding), and the same text for every token from id 5 on. The header
reader decodes only short arrays, so the token lists of real models (tens
or hundreds of thousands of strings) are read here, from their byte spans.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

from supervisor.models.gguf_header import GgufError, read_gguf_kv

# The engine accepts a draft whose token count differs by at most this many
# (padding tokens), and compares the token texts from this id on.
VOCAB_SIZE_SLACK = 128
VOCAB_CHECK_FROM = 5
_TOKENS = "tokenizer.ggml.tokens"
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_SPECIAL = ("tokenizer.ggml.model", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.add_bos_token")


class _Walk:
    """A cursor over a GGUF header that skips values it is not asked for."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.path, self.pos = buf, path, 0

    def u(self, fmt: str) -> int:
        try:
            (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        except struct.error as exc:
            raise GgufError(self.path, "truncated header") from exc
        self.pos += struct.calcsize(fmt)
        return int(value)

    def string(self) -> bytes:
        n = self.u("Q")
        if self.pos + n > len(self.buf):
            raise GgufError(self.path, "truncated header: a string runs past the end")
        self.pos += n
        return bytes(self.buf[self.pos - n:self.pos])

    def skip(self, vtype: int) -> None:
        if vtype in _SCALAR_SIZES:
            self.pos += _SCALAR_SIZES[vtype]
        elif vtype == _STRING:
            n = self.u("Q")  # read first: it moves pos
            self.pos += n
        elif vtype == _ARRAY:
            item, count = self.u("I"), self.u("Q")
            if item in _SCALAR_SIZES:
                self.pos += count * _SCALAR_SIZES[item]
            else:
                for _ in range(count):
                    self.skip(item)
        else:
            raise GgufError(self.path, f"unknown value type {vtype}")
        if self.pos > len(self.buf):
            raise GgufError(self.path, "truncated header: a value runs past the end")


def read_tokens(path: Path) -> list[bytes]:
    """The token texts of a GGUF's vocabulary, as stored (empty without one)."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            cur = _Walk(buf, path)
            if bytes(buf[:4]) != b"GGUF":
                raise GgufError(path, "not a GGUF file (bad magic)")
            cur.pos = 4
            cur.u("I")  # version
            cur.u("Q")  # tensor count
            for _ in range(cur.u("Q")):
                key, vtype = cur.string(), cur.u("I")
                if key.decode("utf-8", "replace") == _TOKENS and vtype == _ARRAY and cur.u("I") == _STRING:
                    return [cur.string() for _ in range(cur.u("Q"))]
                cur.skip(vtype)
    except (OSError, ValueError) as exc:
        raise GgufError(path, f"cannot read file: {exc}") from exc
    return []


def _header(path: Path) -> tuple[dict[str, Any], int]:
    _, _, kv, counts = read_gguf_kv(path)
    return kv, counts.get(_TOKENS, 0)


def vocab_difference(target: Path, draft: Path) -> str | None:
    """Why ``draft`` cannot draft for ``target`` (their vocabularies differ),
    or None. Raises GgufError when a header cannot be read."""
    t_kv, t_n = _header(target)
    d_kv, d_n = _header(draft)
    for key in _SPECIAL:
        if t_kv.get(key) != d_kv.get(key):
            return f"{key} is {d_kv.get(key)!r} in the draft and {t_kv.get(key)!r} in the model"
    if abs(t_n - d_n) > VOCAB_SIZE_SLACK:
        return f"the draft has {d_n} tokens and the model {t_n}"
    t_tokens, d_tokens = read_tokens(target), read_tokens(draft)
    for i in range(VOCAB_CHECK_FROM, min(len(t_tokens), len(d_tokens))):
        if t_tokens[i] != d_tokens[i]:
            return (f"token {i} is {d_tokens[i].decode('utf-8', 'replace')!r} in the draft and "
                    f"{t_tokens[i].decode('utf-8', 'replace')!r} in the model")
    return None
