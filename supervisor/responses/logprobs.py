"""Token log-probabilities from the worker, in the shape both APIs share.

Chat's ``choices[].logprobs.content`` and the Responses API's
``output_text.logprobs`` list the same object per token: ``token``,
``bytes``, ``logprob`` and ``top_logprobs`` (each ``token``, ``bytes``,
``logprob``). The SDKs require ``bytes``; the engine may leave it out for a
token whose text is whole UTF-8, which is then its encoding.

The parser holds text back (a possible marker) and turns some of it into
reasoning or calls, so tokens are matched to visible text per delta:
:class:`TextLogprobs` keeps the tokens of deltas still held back and hands
them out with the next text, and drops those that became anything else.
"""

from __future__ import annotations

from typing import Any

import msgspec

from supervisor.generation.pieces import Piece, Text
from worker.protocol import TokenLogprob, TopLogprob

# Alternatives per token position that ``top_logprobs`` may ask for (as OpenAI).
MAX_TOP_LOGPROBS = 20


class TopEntry(msgspec.Struct):
    token: str
    bytes: list[int]
    logprob: float


class LogprobEntry(msgspec.Struct):
    token: str
    bytes: list[int]
    logprob: float
    top_logprobs: list[TopEntry]


def _bytes(token: str, raw: list[int] | None) -> list[int]:
    return list(raw) if raw is not None else list(token.encode())


def _top(alt: TopLogprob) -> TopEntry:
    return TopEntry(alt.token, _bytes(alt.token, alt.bytes), alt.logprob)


def entries(tokens: list[TokenLogprob]) -> list[LogprobEntry]:
    return [LogprobEntry(t.token, _bytes(t.token, t.bytes), t.logprob, [_top(a) for a in t.top_logprobs])
            for t in tokens]


class TextLogprobs:
    """Assigns each delta's tokens to the visible text they produced."""

    def __init__(self) -> None:
        self._pending: list[LogprobEntry] = []

    def take(self, tokens: list[TokenLogprob] | None, pieces: list[Piece]) -> list[LogprobEntry]:
        """The tokens that belong to the text among ``pieces`` (the output of
        the delta that brought ``tokens``)."""
        if tokens:
            self._pending += entries(tokens)
        if any(isinstance(p, Text) for p in pieces):
            out, self._pending = self._pending, []
            return out
        if pieces:
            # Everything held so far became reasoning or calls.
            self._pending = []
        return []


# Alternatives per position the legacy completions API allows (``logprobs``).
MAX_COMPLETION_LOGPROBS = 5


def completion_logprobs(entries_: list[LogprobEntry], offset: int = 0) -> dict[str, Any]:
    """A legacy completion choice's ``logprobs``: parallel lists, with each
    token's character offset in the choice's text starting at ``offset``."""
    offsets = []
    for e in entries_:
        offsets.append(offset)
        offset += len(e.token)
    return {"tokens": [e.token for e in entries_], "token_logprobs": [e.logprob for e in entries_],
            "top_logprobs": [{t.token: t.logprob for t in e.top_logprobs} for e in entries_],
            "text_offset": offsets}


def chat_logprobs(entries_: list[LogprobEntry]) -> dict[str, Any]:
    """A chat choice's ``logprobs`` object."""
    return {"content": msgspec.to_builtins(entries_), "refusal": None}
