"""Incremental detokenizing: token pieces -> UTF-8 safe text -> stop strings.

Each token's piece is looked up once (a per-token cache), bytes go through an
incremental UTF-8 decoder so a character split across tokens is emitted only
when whole, and text that could still be the start of a stop string is held
back until it cannot be. Cost per token is constant, unlike re-detokenizing
the whole output every step.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence


class StopMatcher:
    """Holds back text that may begin a stop string; finds complete ones."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._buf = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """Add text; return what is safe to emit now."""
        if self.stopped:
            return ""
        self._buf += text
        if not self._stops:
            out, self._buf = self._buf, ""
            return out
        first = -1
        for stop in self._stops:
            idx = self._buf.find(stop)
            if idx != -1 and (first == -1 or idx < first):
                first = idx
        if first != -1:
            self.stopped = True
            out, self._buf = self._buf[:first], ""
            return out
        hold = self._held_suffix()
        cut = len(self._buf) - hold
        out, self._buf = self._buf[:cut], self._buf[cut:]
        return out

    def _held_suffix(self) -> int:
        hold = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(self._buf)), hold, -1):
                if self._buf.endswith(stop[:k]):
                    hold = k
                    break
        return hold

    def flush(self) -> str:
        out, self._buf = ("" if self.stopped else self._buf), ""
        return out


class Detokenizer:
    """Turns a stream of token ids into text deltas."""

    def __init__(self, piece: Callable[[int], bytes], stops: Sequence[str]) -> None:
        self._piece = piece
        self._cache: dict[int, bytes] = {}
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = StopMatcher(stops)

    @property
    def stopped(self) -> bool:
        return self._stop.stopped

    def push(self, token: int) -> str:
        raw = self._cache.get(token)
        if raw is None:
            raw = self._piece(token)
            self._cache[token] = raw
        return self._stop.push(self._utf8.decode(raw))

    def flush(self) -> str:
        tail = self._utf8.decode(b"", final=True)
        return self._stop.push(tail) + self._stop.flush()
