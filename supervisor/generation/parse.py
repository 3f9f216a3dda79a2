"""Split streamed model text into reasoning, visible text and tool calls.

The parser is incremental: :meth:`OutputParser.feed` takes each decoded delta
and returns the pieces that are certain. Text that might be the start of a
marker (``<think>``, ``</think>``, ``<tool_call>``, ``[TOOL_CALLS]``) is held
back until the next delta decides it, so nothing is streamed as visible text
and later turns out to be part of a tool call.

Tool-call formats understood (only when the request offers tools):
- Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
- Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]`` and the newer
  ``[TOOL_CALLS]name[ARGS]{...}``
- Llama 3: ``{"name": ..., "parameters": {...}}`` as the whole output,
  optionally after ``<|python_tag|>``
- DeepSeek: ``<｜tool▁calls▁begin｜>`` then ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>name``
  and the arguments in a fenced json block (R1), or ``name<｜tool▁sep｜>{...}`` (V3.1),
  each closed by ``<｜tool▁call▁end｜>``
A whole call that does not parse, or names an unknown tool, is kept as text.
A call the output ends inside (the token limit, a stop string) is never text:
it becomes an incomplete call (``complete=False``) when its name is known,
with the arguments written so far, and is dropped when it is not. Under a
grammar that forces calls (``forced``), every unfinished marker is dropped too.

The families of :mod:`tagged_calls` (Qwen3-Coder and GLM 4.5 inside
``<tool_call>``, Kimi K2, Functionary v3.2, Command R7B, Granite, Nemotron)
are read when the template's call format (``style``) is theirs; the markers
of one family are plain text under another.

Each format's calls are read in :mod:`json_calls` (Hermes, Llama 3, Mistral),
:mod:`deepseek_calls` and :mod:`tagged_calls`; gpt-oss writes "harmony"
messages instead, read by :class:`~supervisor.generation.harmony.HarmonyParser`.
A call the model closed with a slip in its JSON is read after the safe
repairs of :mod:`arg_repair`.
"""

from __future__ import annotations

import enum
import logging
import re

from supervisor.generation import tagged_calls as tc
from supervisor.generation.arg_repair import repair_json
from supervisor.generation.deepseek_calls import (
    parse_deepseek_calls,
    partial_deepseek_calls,
)
from supervisor.generation.grammar import DEEPSEEK_CALL_BEGIN, DEEPSEEK_CALLS_BEGIN
from supervisor.generation.json_calls import (
    MISTRAL_CALLS,
    parse_json_calls,
    parse_mistral_calls,
    partial_json_calls,
    partial_mistral_calls,
)
from supervisor.generation.pieces import (
    Piece,
    Reasoning,
    StreamParser,
    Text,
    ToolCall,
    held_suffix,
)

# The pieces are imported from here by callers that only parse.
__all__ = ["OutputParser", "Piece", "Reasoning", "StreamParser", "Text", "ToolCall"]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"

# Markers that open calls closed by another marker, by the opening one.
_CLOSING = {HERMES_OPEN: HERMES_CLOSE, tc.KIMI_SECTION_OPEN: tc.KIMI_SECTION_CLOSE,
            tc.R7B_OPEN: tc.R7B_CLOSE, tc.NEMOTRON_OPEN: tc.NEMOTRON_CLOSE}
# Each family's own markers, on top of those every family shares.
_STYLE_MARKERS: dict[str, tuple[str, ...]] = {
    "kimi_k2": (tc.KIMI_SECTION_OPEN,),
    "functionary_v32": (tc.FUNCTIONARY_OPEN,),
    "command_r7b": (tc.R7B_OPEN, *tc.R7B_RESPONSE_MARKERS),
    "granite": (tc.GRANITE_OPEN,),
    "nemotron": (tc.NEMOTRON_OPEN,),
}
_THINK_MARKERS = {"command_r7b": tc.R7B_THINKING}
# Markup around plain text, dropped from it.
_DROPPED = frozenset(tc.R7B_RESPONSE_MARKERS)
# Kimi K2's arguments, each closed by the model: what a repair may touch.
_KIMI_ARGS = re.compile(re.escape(tc.KIMI_ARGS) + "(.*?)" + re.escape(tc.KIMI_CALL_CLOSE), re.DOTALL)

log = logging.getLogger(__name__)


class _State(enum.Enum):
    REASONING = "reasoning"
    TEXT = "text"
    CLOSED_CALLS = "closed_calls"  # inside <tool_call> (or the like), until its closing marker
    TRAILING_CALLS = "trailing_calls"  # Mistral / Llama 3 / DeepSeek: calls run to the end



class OutputParser:
    """Feed decoded text; get pieces that can be emitted now."""

    def __init__(
        self,
        *,
        thinking: bool = False,
        starts_in_reasoning: bool = False,
        tool_names: frozenset[str] = frozenset(),
        bare_json_calls: bool = True,
        forced: bool = False,
        style: str = "hermes",
        schemas: tc.Schemas | None = None,
    ) -> None:
        self._thinking = thinking or starts_in_reasoning
        # A grammar forces calls: no visible text can follow, only markup.
        self._forced = forced
        self._names = tool_names
        self._style = style
        # Qwen3-Coder and GLM 4.5 type raw values by the schema; unknown: by what they spell.
        self._schemas: tc.Schemas = {n: (schemas or {}).get(n) for n in tool_names}
        self._open = HERMES_OPEN
        # Command R7B writes its reasoning between markers of its own.
        self._think_open, self._think_close = _THINK_MARKERS.get(style, (THINK_OPEN, THINK_CLOSE))
        self._bare_json = bare_json_calls and bool(tool_names)
        self._state = _State.REASONING if starts_in_reasoning else _State.TEXT
        self._buf = ""
        self._trailing_prefix = ""
        # True until the current text run has shown a non-space character.
        self._fresh = True
        self._output_started = False
        self._visible_started = False
        self._text_markers = self._markers()
        # Every marker starts with one of these; text without them is plain.
        self._marker_starts = "".join(sorted({m[0] for m in self._text_markers}))

    @property
    def in_reasoning(self) -> bool:
        return self._state is _State.REASONING

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        progressed = True
        while progressed and self._buf:
            progressed = self._step(out)
        return out

    def finish(self) -> list[Piece]:
        out = self.feed("")
        buf, self._buf = self._buf, ""
        match self._state:
            case _State.REASONING:
                if self._forced:
                    # The grammar's "</think>" cut short is markup, not reasoning.
                    buf = buf[: len(buf) - held_suffix(buf, (self._think_close,))]
                if buf:
                    out.append(Reasoning(buf))
            case _State.TEXT:
                # Under a forced call, what is held back is the start of a marker.
                if not self._forced and (buf.strip() or (buf and not self._fresh)):
                    out.append(Text(buf))
            case _State.CLOSED_CALLS:
                out.extend(self._closed_calls(buf, closed=False))
            case _State.TRAILING_CALLS:
                out.extend(self._trailing_calls(buf))
        return out

    # ---------------------------------------------------------------- states

    def _step(self, out: list[Piece]) -> bool:
        match self._state:
            case _State.REASONING:
                return self._step_reasoning(out)
            case _State.TEXT:
                return self._step_text(out)
            case _State.CLOSED_CALLS:
                return self._step_closed(out)
            case _State.TRAILING_CALLS:
                return False

    def _step_reasoning(self, out: list[Piece]) -> bool:
        if not self._output_started:
            # A template that opens <think> itself may still see the model repeat it.
            stripped = self._buf.lstrip()
            if self._think_open.startswith(stripped) and stripped != self._think_open:
                return False
            if stripped.startswith(self._think_open):
                self._buf = stripped[len(self._think_open) :]
            self._output_started = True
        if self._fresh:
            self._buf = self._buf.lstrip()
        end = self._buf.find(self._think_close)
        if end >= 0:
            if end:
                out.append(Reasoning(self._buf[:end]))
            self._fresh = False
            self._buf = self._buf[end + len(self._think_close) :]
            self._enter_text()
            return True
        keep = held_suffix(self._buf, (self._think_close,))
        if len(self._buf) > keep:
            out.append(Reasoning(self._buf[: len(self._buf) - keep]))
            self._buf = self._buf[len(self._buf) - keep :]
            self._fresh = False
        return False

    def _markers(self) -> tuple[str, ...]:
        markers: tuple[str, ...] = (self._think_open,) if self._thinking else ()
        if self._names:
            markers += (HERMES_OPEN, MISTRAL_CALLS, PYTHON_TAG, DEEPSEEK_CALLS_BEGIN, DEEPSEEK_CALL_BEGIN)
            markers += _STYLE_MARKERS.get(self._style, ())
        elif self._style == "command_r7b":
            markers += tc.R7B_RESPONSE_MARKERS
        return markers

    def _step_text(self, out: list[Piece]) -> bool:
        markers = self._text_markers
        if not self._fresh and not any(c in self._buf for c in self._marker_starts):
            # Hot path: most deltas of a plain answer.
            self._emit_text(out, self._buf)
            self._buf = ""
            return False
        if self._fresh:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            maybe_marker = any(m.startswith(self._buf[: len(m)]) for m in markers)
            if self._bare_json and not self._visible_started and self._buf[0] in "{[" and not maybe_marker:
                self._state = _State.TRAILING_CALLS
                self._trailing_prefix = ""
                return False
        self._output_started = True
        found = [(self._buf.find(m), m) for m in markers]
        hits = [(pos, m) for pos, m in found if pos >= 0]
        if hits:
            pos, marker = min(hits)
            self._emit_text(out, self._buf[:pos])
            rest = self._buf[pos + len(marker) :]
            if marker == tc.FUNCTIONARY_OPEN and rest.startswith(tc.FUNCTIONARY_TEXT + "\n"):
                # ">>>all\n" opens Functionary's plain text.
                self._buf = rest[4:]
                return True
            if marker == tc.FUNCTIONARY_OPEN and (tc.FUNCTIONARY_TEXT + "\n").startswith(rest):
                self._buf = self._buf[pos:]  # "all" or a name: the next delta decides
                return False
            self._buf = rest
            if marker not in _DROPPED:
                self._enter_marker(marker)
            return True
        keep = held_suffix(self._buf, markers)
        self._emit_text(out, self._buf[: len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep :]
        return False

    def _emit_text(self, out: list[Piece], text: str) -> None:
        if text:
            out.append(Text(text))
            self._fresh = False
            self._visible_started = True

    def _enter_marker(self, marker: str) -> None:
        if marker == self._think_open:
            self._state = _State.REASONING
            self._fresh = True
        elif marker in _CLOSING:
            self._state = _State.CLOSED_CALLS
            self._open = marker
        else:
            self._state = _State.TRAILING_CALLS
            self._trailing_prefix = marker

    def _enter_text(self) -> None:
        self._state = _State.TEXT
        self._fresh = True

    def _step_closed(self, out: list[Piece]) -> bool:
        close = _CLOSING[self._open]
        end = self._buf.find(close)
        if end < 0:
            return False
        body = self._buf[:end]
        self._buf = self._buf[end + len(close) :]
        out.extend(self._closed_calls(body, closed=True))
        self._enter_text()
        return True

    def _closed_calls(self, body: str, *, closed: bool) -> list[Piece]:
        self._visible_started = True
        close = _CLOSING[self._open]
        # A stop string or the token limit may have cut the closing tag.
        cut = body if closed else body[: len(body) - held_suffix(body, (close,))]
        glm = self._open == HERMES_OPEN and cut.strip()[:1] not in ("{", "[", "<", "")
        # A GLM 4.5 call ends only at its closing tag: without it, more arguments were to come.
        calls = None if glm and not closed else self._whole_closed(cut)
        if calls:
            return list(calls)
        if not closed:
            return list(self._partial_closed(cut))
        calls = self._repaired(body)
        if calls:
            return list(calls)
        log.warning("a tool call that does not parse or names no offered tool is left as text: %.120r", body)
        return [Text(self._open + body + close)]

    def _repaired(self, body: str) -> list[ToolCall] | None:
        """The calls of a closed body after the safe JSON repairs (:mod:`arg_repair`)."""
        whats: list[str] = []

        def fixed(text: str) -> str:
            repaired = repair_json(text.strip())
            if repaired is None:
                return text
            whats.append(repaired.what)
            return repaired.text

        if self._open == tc.KIMI_SECTION_OPEN:
            body = _KIMI_ARGS.sub(lambda m: tc.KIMI_ARGS + fixed(m.group(1)) + tc.KIMI_CALL_CLOSE, body)
        elif self._open != HERMES_OPEN or body.strip()[:1] in ("{", "["):
            body = fixed(body)
        calls = self._whole_closed(body) if whats else None
        if calls:
            log.info("repaired a tool call's JSON: %s", "; ".join(whats))
        return calls

    def _whole_closed(self, body: str) -> list[ToolCall] | None:
        if self._open == tc.KIMI_SECTION_OPEN:
            return tc.parse_kimi_calls(body, self._names)
        if self._open != HERMES_OPEN:
            return tc.parse_list_calls(self._open, body, self._names)
        if tc.xml_body(body):
            return tc.parse_xml_calls(body, self._schemas)
        if body.strip()[:1] not in ("{", "["):
            return tc.parse_glm_call(body, self._schemas)
        return parse_json_calls(body, self._names)

    def _partial_closed(self, body: str) -> list[ToolCall]:
        if self._open == tc.KIMI_SECTION_OPEN:
            return tc.partial_kimi_calls(body, self._names)
        if self._open != HERMES_OPEN:
            return tc.partial_list_calls(self._open, body, self._names)
        start = body.strip()[:1]
        if start == "<":
            return tc.partial_xml_calls(body, self._schemas)
        if start not in ("{", "[", ""):
            return tc.partial_glm_call(body, self._schemas)
        return partial_json_calls(body, self._names)

    def _trailing_calls(self, buf: str) -> list[Piece]:
        """Calls run to the end of the output: ones that do not parse were cut short there."""
        prefix = self._trailing_prefix
        if prefix == MISTRAL_CALLS:
            calls = parse_mistral_calls(buf, self._names)
        elif prefix in (DEEPSEEK_CALLS_BEGIN, DEEPSEEK_CALL_BEGIN):
            calls = parse_deepseek_calls(prefix + buf, self._names)
        elif prefix == tc.FUNCTIONARY_OPEN:
            calls = tc.parse_functionary_calls(buf, self._names)
        elif prefix == tc.GRANITE_OPEN:
            calls = tc.parse_list_calls(prefix, buf, self._names)
        else:
            calls = parse_json_calls(buf, self._names)
        if calls:
            return list(calls)
        partial = self._partial_trailing(prefix, buf)
        # Bare JSON that is no call is an answer; after a marker it is markup.
        if partial or prefix or self._forced:
            return list(partial)
        return [Text(buf)] if buf.strip() else []

    def _partial_trailing(self, prefix: str, buf: str) -> list[ToolCall]:
        if prefix == MISTRAL_CALLS:
            return partial_mistral_calls(buf, self._names)
        if prefix in (DEEPSEEK_CALLS_BEGIN, DEEPSEEK_CALL_BEGIN):
            return partial_deepseek_calls(prefix + buf, self._names)
        if prefix == tc.FUNCTIONARY_OPEN:
            return tc.partial_functionary_calls(buf, self._names)
        if prefix == tc.GRANITE_OPEN:
            return tc.partial_list_calls(prefix, buf, self._names)
        return partial_json_calls(buf, self._names)
