"""Read llama.cpp's generic tool-call format back (see :mod:`generic_calls`).

The output is one JSON object: ``{"tool_call": {...}}``, ``{"tool_calls":
[...]}`` or ``{"response": ...}``. An answer's string is streamed as it is
written, decoded (escapes, surrogate pairs); calls come whole at the end, or
as an incomplete call when the output ends inside one (the token limit).
Output that is not this object (no grammar held it) is text.
"""

from __future__ import annotations

import enum
import json
import re

from supervisor.generation.generic_calls import ANSWER_KEY, CALL_KEY, CALLS_KEY
from supervisor.generation.json_calls import call_from, partial_json_calls
from supervisor.generation.pieces import Piece, Text

THINK_CLOSE = "</think>"
# The object's opening up to its first value: '{"response": '.
_HEAD = re.compile(r'\s*\{\s*"((?:[^"\\]|\\.)*)"\s*:\s*')
# An opening longer than this that is still no head is not the format.
_MAX_HEAD = 64


class _State(enum.Enum):
    START = "start"  # before the object's first key
    ANSWER = "answer"  # in the answer's string
    AFTER_ANSWER = "after_answer"  # the string ended: only the closing brace is left
    HELD = "held"  # calls, a JSON answer, or something else: read at the end
    TEXT = "text"  # not the format: plain text


def _lone_surrogates_replaced(text: str) -> str:
    # "\ud800" alone is valid JSON but no character: it could not be sent as UTF-8.
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _decodable(raw: str, start: int) -> tuple[int, bool]:
    """How far from ``start`` the JSON string body ``raw`` can be decoded now
    (not inside an escape or a surrogate pair), and whether its closing quote is there."""
    i = start
    while i < len(raw):
        c = raw[i]
        if c == '"':
            return i, True
        if c != "\\":
            i += 1
            continue
        if i + 1 >= len(raw):
            break
        if raw[i + 1] != "u":
            i += 2
            continue
        if i + 6 > len(raw):
            break
        high = raw[i + 2 : i + 6]
        if high[0] in "dD" and high[1] in "89abAB":
            if i + 12 > len(raw):
                break  # the low half of the pair may follow
            i += 12
        else:
            i += 6
    return i, False


def _decoded(body: str) -> str:
    try:
        return _lone_surrogates_replaced(json.loads(f'"{body}"'))
    except ValueError:
        return body  # no grammar held it to JSON: the text as written


class GenericParser:
    """A :class:`~supervisor.generation.pieces.StreamParser` for the generic format."""

    def __init__(self, tool_names: frozenset[str], *, forced: bool = False, after_think: bool = False) -> None:
        self._names = tool_names
        # A grammar forces a call: what is not one is markup, never text.
        self._forced = forced
        # A template that opened a think block: the grammar closes it first.
        self._after_think = after_think
        self._state = _State.START
        self._buf = ""
        self._pos = 0  # where the answer's undecoded text starts in _buf

    @property
    def in_reasoning(self) -> bool:
        return False

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        if self._state is _State.START:
            self._start()
        if self._state is _State.ANSWER:
            return self._answer()
        if self._state is _State.TEXT and self._buf:
            text, self._buf = self._buf, ""
            return [Text(text)]
        return []

    def finish(self) -> list[Piece]:
        out = self.feed("")
        # Ended inside the answer's string, the answer is what was decoded (a
        # cut escape is no text); calls and JSON answers are read only now.
        if self._state in (_State.START, _State.HELD):
            out += self._held()
        self._buf = ""
        return [p for p in out if not isinstance(p, Text) or p.text]

    def _start(self) -> None:
        buf = self._buf.lstrip()
        if self._after_think:
            if THINK_CLOSE.startswith(buf):
                return  # the grammar's "</think>" may be on its way
            if buf.startswith(THINK_CLOSE):
                self._buf = buf = buf[len(THINK_CLOSE) :].lstrip()
                self._after_think = False
        if not buf:
            return
        if buf[0] != "{":
            self._state = _State.TEXT
            return
        head = _HEAD.match(buf)
        if head is None:
            if len(buf) > _MAX_HEAD:
                self._state = _State.HELD
            return
        answer = head.group(1) == ANSWER_KEY
        rest = buf[head.end() :]
        if answer and not rest:
            return  # the answer's value is not begun: a string or JSON?
        if answer and rest[0] == '"':
            self._buf = rest
            self._pos = 1
            self._state = _State.ANSWER
            return
        self._state = _State.HELD

    def _answer(self) -> list[Piece]:
        end, closed = _decodable(self._buf, self._pos)
        text = _decoded(self._buf[self._pos : end]) if end > self._pos else ""
        self._pos = end
        if closed:
            self._state = _State.AFTER_ANSWER
        return [Text(text)] if text else []

    def _held(self) -> list[Piece]:
        """What the output held to its end: calls, a JSON answer, or text."""
        buf = self._buf.strip()
        if self._after_think and buf.startswith(THINK_CLOSE):
            buf = buf[len(THINK_CLOSE) :].lstrip()
        head = _HEAD.match(buf)
        decoder = json.JSONDecoder()
        try:
            value, _ = decoder.raw_decode(buf)
        except ValueError:
            return self._cut(buf, head)
        if head is None or not isinstance(value, dict) or len(value) != 1:
            return self._text(buf)
        inner = value[next(iter(value))]
        if head.group(1) == CALL_KEY:
            call = call_from(inner, self._names)
            return [call] if call is not None else self._text(buf)
        if head.group(1) == CALLS_KEY and isinstance(inner, list) and inner:
            calls = [call_from(c, self._names) for c in inner]
            whole = [c for c in calls if c is not None]
            return list(whole) if len(whole) == len(calls) else self._text(buf)
        if head.group(1) == ANSWER_KEY:
            if isinstance(inner, str):
                return [Text(inner)]
            # A JSON answer (the request's output format) as the model wrote it.
            raw = buf[head.end() :]
            return [Text(raw[: decoder.raw_decode(raw)[1]])]
        return self._text(buf)

    def _text(self, buf: str) -> list[Piece]:
        """Output that is not the format: text, unless a grammar forced a call."""
        return [] if self._forced or not buf else [Text(buf)]

    def _cut(self, buf: str, head: re.Match[str] | None) -> list[Piece]:
        """An object the output ended inside: whole calls and the cut one, or
        the JSON answer written so far."""
        if head is not None and head.group(1) in (CALL_KEY, CALLS_KEY):
            return list(partial_json_calls(buf[head.end() :], self._names))
        if head is not None and head.group(1) == ANSWER_KEY:
            return [Text(buf[head.end() :])]
        return self._text(buf)
