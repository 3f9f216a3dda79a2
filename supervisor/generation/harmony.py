"""gpt-oss "harmony" output: messages, each a header, ``<|message|>``, a body
and an end token. The channel and recipient in the header say whether a body
is reasoning, visible text or a tool call's JSON arguments.
"""

from __future__ import annotations

import enum
import re

from supervisor.generation.json_calls import call_from, known_name, whole_json_prefix
from supervisor.generation.pieces import Piece, Reasoning, Text, ToolCall, held_suffix

HARMONY_START = "<|start|>"
HARMONY_CHANNEL = "<|channel|>"
HARMONY_MESSAGE = "<|message|>"
# Tokens that end a message: a turn (<|end|>), the reply (<|return|>), a call (<|call|>).
HARMONY_ENDS = ("<|end|>", "<|return|>", "<|call|>")
# Where a message body stops without being ended: the next message's header.
_HARMONY_BOUNDS = (HARMONY_START, HARMONY_CHANNEL)
# A header longer than this is not one: the text is an answer without channels.
_MAX_HEADER = 256
_RECIPIENT = re.compile(r"to=([^\s<]+)")
# A recipient the output ended inside: the name is whole once something follows it.
_CUT_RECIPIENT = re.compile(r"to=functions\.([^\s<]*)([\s<])?")
_CHANNEL = re.compile(re.escape(HARMONY_CHANNEL) + r"([^\s<]*)")


class _Harmony(enum.Enum):
    HEADER = "header"  # before <|message|>: channel and recipient
    REASONING = "reasoning"  # the analysis channel
    TEXT = "text"  # final (or commentary without a recipient: a preamble)
    CALL = "call"  # a message to a function: its JSON arguments


def _could_be_header(buf: str) -> bool:
    """Whether ``buf`` starts (or may yet start) a message header.

    A header is ``<|start|>assistant``, then ``<|channel|>name``, and maybe
    ``to=functions.name`` before or after the channel (the prompt already
    wrote the first ``<|start|>assistant``)."""
    text = buf.lstrip()
    opens = (HARMONY_START, HARMONY_CHANNEL, "to=")
    return len(buf) <= _MAX_HEADER and any(text.startswith(o) or o.startswith(text) for o in opens)


def _without_cut_marker(text: str) -> str:
    """``text`` less a harmony marker the output ended inside (``<|en``): markup, never text."""
    keep = held_suffix(text, (*HARMONY_ENDS, *_HARMONY_BOUNDS))
    return text[: len(text) - keep] if keep >= 2 else text


class HarmonyParser:
    """gpt-oss output: analysis messages are reasoning, final (and preamble)
    messages text, and a message addressed ``to=functions.NAME`` a call whose
    body is its JSON arguments. Text that does not follow the format at all is
    an answer. Only certain pieces are emitted, as in :class:`OutputParser`."""

    def __init__(self, *, tool_names: frozenset[str] = frozenset(), forced: bool = False) -> None:
        self._names = tool_names
        # A grammar forces a call: whatever is left of a header is markup.
        self._forced = forced
        self._state = _Harmony.HEADER
        self._buf = ""
        self._header = ""
        self._recipient: str | None = None

    @property
    def in_reasoning(self) -> bool:
        return self._state is _Harmony.REASONING

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while self._buf and self._step(out):
            pass
        return out

    def finish(self) -> list[Piece]:
        out = self.feed("")
        buf, self._buf = self._buf, ""
        match self._state:
            case _Harmony.HEADER:
                # A header cut short is markup (a call's, when it names one); anything else was an answer.
                call = self._cut_header(buf)
                if call is not None:
                    out.append(call)
                elif buf.strip() and not self._forced and not buf.lstrip().startswith("<|"):
                    out.append(Text(buf))
            case _Harmony.REASONING | _Harmony.TEXT:
                self._emit(out, _without_cut_marker(buf))
            case _Harmony.CALL:
                out.extend(self._cut_call(_without_cut_marker(buf)))
        return out

    def _cut_header(self, header: str) -> ToolCall | None:
        found = _CUT_RECIPIENT.search(header)
        if found is None:
            return None
        name = known_name(found.group(1), self._names, whole=found.group(2) is not None)
        return ToolCall(name, "", complete=False) if name is not None else None

    def _cut_call(self, body: str) -> list[Piece]:
        """A call message the output ended inside: whole if its arguments are, else incomplete."""
        recipient = self._recipient or ""
        name = recipient.removeprefix("functions.")
        if not recipient.startswith("functions.") or name not in self._names:
            return []
        whole = call_from({"name": name, "arguments": body.strip()}, self._names)
        return [whole if whole is not None else ToolCall(name, whole_json_prefix(body.strip()), complete=False)]

    def _step(self, out: list[Piece]) -> bool:
        if self._state is _Harmony.HEADER:
            return self._step_header()
        return self._step_body(out)

    def _step_header(self) -> bool:
        pos = self._buf.find(HARMONY_MESSAGE)
        header = self._buf if pos < 0 else self._buf[:pos]
        if not _could_be_header(header):
            self._state = _Harmony.TEXT
            return True
        if pos < 0:
            return False
        self._header = header
        self._buf = self._buf[pos + len(HARMONY_MESSAGE) :]
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        self._recipient = recipient.group(1) if recipient else None
        if self._recipient is not None:
            self._state = _Harmony.CALL
        elif channel is not None and channel.group(1) == "analysis":
            self._state = _Harmony.REASONING
        else:
            self._state = _Harmony.TEXT
        return True

    def _step_body(self, out: list[Piece]) -> bool:
        hits = [(self._buf.find(m), m) for m in (*HARMONY_ENDS, *_HARMONY_BOUNDS)]
        found = [(pos, m) for pos, m in hits if pos >= 0]
        if not found:
            if self._state is not _Harmony.CALL:
                keep = held_suffix(self._buf, (*HARMONY_ENDS, *_HARMONY_BOUNDS))
                self._emit(out, self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
            return False
        pos, marker = min(found)
        body = self._buf[:pos]
        # An end token is consumed; the start of a next header is left to read.
        self._buf = self._buf[pos + len(marker) :] if marker in HARMONY_ENDS else self._buf[pos:]
        if self._state is _Harmony.CALL:
            out.append(self._call(body))
        else:
            self._emit(out, body)
        self._state = _Harmony.HEADER
        return True

    def _emit(self, out: list[Piece], text: str) -> None:
        if text:
            out.append(Reasoning(text) if self._state is _Harmony.REASONING else Text(text))

    def _call(self, body: str) -> Piece:
        name = (self._recipient or "").removeprefix("functions.")
        call = None
        if self._recipient is not None and self._recipient.startswith("functions."):
            call = call_from({"name": name, "arguments": body.strip()}, self._names)
        # Not a call we can make (unknown function, broken arguments): kept as text.
        return call if call is not None else Text(self._header + HARMONY_MESSAGE + body)
