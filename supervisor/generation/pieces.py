"""The pieces a model's output is parsed into, and what every parser shares.

A parser turns streamed text into :class:`Reasoning`, :class:`Text` and
:class:`ToolCall` pieces; :func:`held_suffix` is how each holds back text that
might be the start of a marker until the next delta decides it.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol


class Reasoning(NamedTuple):
    text: str


class Text(NamedTuple):
    text: str


class ToolCall(NamedTuple):
    name: str
    arguments: str
    # False for a call the output ended inside: its arguments are what was written.
    complete: bool = True
    # The namespace tool of the function (set after parsing; the model sees "namespace.name").
    namespace: str | None = None


Piece = Reasoning | Text | ToolCall


class StreamParser(Protocol):
    """What the routes need of a parser: pieces per delta, then the rest."""

    @property
    def in_reasoning(self) -> bool: ...

    def feed(self, text: str) -> list[Piece]: ...

    def finish(self) -> list[Piece]: ...



def held_suffix(buf: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of ``buf`` that starts some marker."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(buf)), best, -1):
            if marker.startswith(buf[-n:]):
                best = n
                break
    return best
