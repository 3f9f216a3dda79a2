"""Cutting a file's text into overlapping chunks of at most N tokens.

Sizes are in the embedding model's own tokens, counted by its worker's
tokenizer (the parent has none): OpenAI's default is 800 tokens with 400
overlapping, ours is 400 with 200, half of it, because llama.cpp embeds an
input only within one physical batch (512 tokens unless configured) and
refuses a longer one; halving keeps OpenAI's one-half overlap. Chunks end at
whitespace where there is some nearby, so words stay whole.

Counting every candidate exactly would cost one tokenizer call per word, so
a chunk's extent is first guessed from the characters-per-token ratio seen
so far, then counted once; a guess over the limit is shrunk by what the
count says and counted again (rarely more than once).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from supervisor.errors import BadRequest

# llama.cpp's default physical batch: an embedding input must fit in one.
EMBED_MAX_TOKENS = 512
MIN_CHUNK_TOKENS = 100
# How far back a cut looks for whitespace before it cuts inside a word.
SNAP_CHARS = 64
# The text the first ratio is measured on.
CALIBRATION_CHARS = 8192
# Tries to bring a guessed chunk under the limit before cutting it by characters.
MAX_TRIES = 8

Counter = Callable[[str], Awaitable[int]]


@dataclass(frozen=True)
class ChunkSize:
    max_tokens: int = 400
    overlap_tokens: int = 200

    @classmethod
    def checked(cls, max_tokens: int, overlap_tokens: int, param: str) -> ChunkSize:
        """The static strategy a request asked for, within what the engine embeds."""
        if not MIN_CHUNK_TOKENS <= max_tokens <= EMBED_MAX_TOKENS:
            raise BadRequest(f"max_chunk_size_tokens must be from {MIN_CHUNK_TOKENS} to {EMBED_MAX_TOKENS} "
                             "(an embedding input must fit in the engine's 512-token batch)",
                             param=f"{param}.static.max_chunk_size_tokens")
        if not 0 <= overlap_tokens <= max_tokens // 2:
            raise BadRequest("chunk_overlap_tokens must be from 0 to half of max_chunk_size_tokens",
                             param=f"{param}.static.chunk_overlap_tokens")
        return cls(max_tokens, overlap_tokens)

    def to_object(self) -> dict[str, object]:
        return {"type": "static", "static": {"max_chunk_size_tokens": self.max_tokens,
                                             "chunk_overlap_tokens": self.overlap_tokens}}


def _snap(text: str, pos: int, floor: int) -> int:
    """``pos`` moved back to just before whitespace, if some lies within
    SNAP_CHARS and after ``floor``; the end of the text stays the end."""
    if pos >= len(text):
        return len(text)
    for i in range(pos, max(floor, pos - SNAP_CHARS), -1):
        if text[i].isspace():
            return i
    return pos


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


async def chunk_text(text: str, size: ChunkSize, count: Counter) -> list[str]:
    """The chunks of ``text``, in order, each at most ``size.max_tokens`` by ``count``."""
    start = _skip_space(text, 0)
    if start >= len(text):
        return []
    sample = text[start:start + CALIBRATION_CHARS]
    ratio = len(sample) / max(1, await count(sample))
    chunks: list[str] = []
    while start < len(text):
        end, tokens = await _fit(text, start, size.max_tokens, ratio, count)
        piece = text[start:end].strip()
        if piece:
            chunks.append(piece)
        if end >= len(text):
            break
        ratio = (end - start) / max(1, tokens)
        back = int(size.overlap_tokens * ratio)
        nxt = _snap(text, end - back, start + 1) if back else end
        start = _skip_space(text, max(nxt, start + 1))
    return chunks


async def _fit(text: str, start: int, limit: int, ratio: float, count: Counter) -> tuple[int, int]:
    """(end, tokens): the chunk from ``start`` that ``count`` puts within ``limit``."""
    span = max(1, int(limit * ratio))
    end = _snap(text, start + span, start + 1)
    tokens = limit + 1
    for _ in range(MAX_TRIES):
        tokens = await count(text[start:end])
        if tokens <= limit or end - start <= 1:
            return end, tokens
        # Shrink by what the count says, a tenth more, so the next try fits.
        span = max(1, int((end - start) * limit / tokens * 0.9))
        end = _snap(text, start + span, start + 1)
    # Each try shrank it; a text this unlike its ratio gets a cut by
    # characters at the last size, counted once more.
    while tokens > limit and end - start > 1:
        end = start + (end - start) // 2
        tokens = await count(text[start:end])
    return end, tokens
