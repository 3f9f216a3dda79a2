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

gpt-oss writes "harmony" messages instead, each a header, ``<|message|>``, a
body and an end token; :class:`HarmonyParser` reads those.
"""

from __future__ import annotations

import enum
import json
import re
from typing import Any, NamedTuple, Protocol

from supervisor.generation.grammar import (
    DEEPSEEK_CALL_BEGIN,
    DEEPSEEK_CALL_END,
    DEEPSEEK_CALLS_BEGIN,
    DEEPSEEK_CALLS_END,
    DEEPSEEK_SEP,
)

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
MISTRAL_CALLS = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"
MISTRAL_CALL_ID = "[CALL_ID]"
PYTHON_TAG = "<|python_tag|>"
# DeepSeek's arguments, fenced as in its template; the fence is optional (V3.1).
_DEEPSEEK_FENCE = re.compile(r"^\s*```(?:json)?\s*\n?(.*?)\n?\s*```\s*$", re.DOTALL)


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


class _State(enum.Enum):
    REASONING = "reasoning"
    TEXT = "text"
    HERMES = "hermes"  # inside <tool_call>, until </tool_call>
    TRAILING_CALLS = "trailing_calls"  # Mistral / Llama 3 / DeepSeek: calls run to the end


def _held_suffix(buf: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of ``buf`` that starts some marker."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(buf)), best, -1):
            if marker.startswith(buf[-n:]):
                best = n
                break
    return best


def _encode_arguments(args: Any) -> str | None:
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
        return args
    if isinstance(args, dict):
        return json.dumps(args, ensure_ascii=False)
    return None


def _call_from(obj: Any, names: frozenset[str]) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    encoded = _encode_arguments(args)
    return ToolCall(obj["name"], encoded) if encoded is not None else None


def _json_values(text: str) -> list[Any] | None:
    """Every JSON value in ``text``, separated by whitespace or ``;``."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    pos = 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n;,":
            pos += 1
        if pos == len(text):
            return values
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        values.append(value)


def parse_json_calls(text: str, names: frozenset[str]) -> list[ToolCall] | None:
    """Calls written as JSON objects or lists of them; None if any part is not one."""
    values = _json_values(text)
    if not values:
        return None
    calls: list[ToolCall] = []
    for value in values:
        for obj in value if isinstance(value, list) else [value]:
            call = _call_from(obj, names)
            if call is None:
                return None
            calls.append(call)
    return calls


def parse_mistral_calls(text: str, names: frozenset[str]) -> list[ToolCall] | None:
    """The text after ``[TOOL_CALLS]``: a JSON list, or ``name[ARGS]{...}`` segments."""
    calls: list[ToolCall] = []
    for segment in text.split(MISTRAL_CALLS):
        segment = segment.strip()
        if not segment:
            continue
        if MISTRAL_ARGS in segment and not segment.startswith(("[", "{")):
            name, _, args = segment.partition(MISTRAL_ARGS)
            # Histories render ``name[CALL_ID]id[ARGS]``; a model may copy that.
            name = name.partition(MISTRAL_CALL_ID)[0]
            call = _call_from({"name": name.strip(), "arguments": args.strip()}, names)
            found = [call] if call is not None else None
        else:
            found = parse_json_calls(segment, names)
        if found is None:
            return None
        calls.extend(found)
    return calls or None


def _deepseek_call(segment: str, names: frozenset[str]) -> ToolCall | None:
    """``function<｜tool▁sep｜>name`` + fenced arguments, or ``name<｜tool▁sep｜>{...}``."""
    head, sep, rest = segment.partition(DEEPSEEK_SEP)
    if not sep:
        return None
    if head.strip() == "function":
        name, _, args = rest.partition("\n")
    else:
        name, args = head, rest
    fenced = _DEEPSEEK_FENCE.match(args)
    return _call_from({"name": name.strip(), "arguments": (fenced.group(1) if fenced else args).strip()}, names)


def parse_deepseek_calls(text: str, names: frozenset[str]) -> list[ToolCall] | None:
    """Calls in ``<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>``; None if any part is not one."""
    body = text.strip().removeprefix(DEEPSEEK_CALLS_BEGIN)
    # Whatever follows the closing marker (an end-of-sentence token) is not part of any call.
    body = body.partition(DEEPSEEK_CALLS_END)[0]
    calls: list[ToolCall] = []
    for segment in body.split(DEEPSEEK_CALL_BEGIN):
        segment = segment.strip()
        if not segment:
            continue
        # The last call of a reply cut by the token limit has no end marker: kept only if whole.
        call = _deepseek_call(segment.removesuffix(DEEPSEEK_CALL_END), names)
        if call is None:
            return None
        calls.append(call)
    return calls or None


# --------------------------------------------------------- calls cut short

_PARTIAL_NAME = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)(")?')
_PARTIAL_ARGS = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def known_name(written: str, names: frozenset[str], *, whole: bool) -> str | None:
    """The tool a name cut short means: itself when ``whole``, else the one tool it starts."""
    if whole:
        return written if written in names else None
    found = [name for name in names if name.startswith(written)]
    return found[0] if len(found) == 1 else None


def _partial_json_call(text: str, names: frozenset[str]) -> ToolCall | None:
    """``{"name": "get_wea`` or ``{"name": "f", "arguments": {"a": 1`` as an incomplete call."""
    found = _PARTIAL_NAME.match(text)
    if found is None:
        return None
    name = known_name(found.group(1), names, whole=found.group(2) is not None)
    if name is None:
        return None
    rest = text[found.end() :]
    key = _PARTIAL_ARGS.match(rest)
    args = rest[key.end() :] if key else ""
    return ToolCall(name, _whole_json_prefix(args), complete=False)


def _whole_json_prefix(args: str) -> str:
    """``args`` up to the end of a whole JSON value at its start (what follows,
    such as a model's own "id" field or a marker cut short, is not arguments);
    all of it when the output ended inside the value."""
    try:
        _, end = json.JSONDecoder().raw_decode(args)
    except ValueError:
        return args
    return args[:end]


def partial_json_calls(text: str, names: frozenset[str]) -> list[ToolCall]:
    """The calls of JSON text the output ended inside: whole ones, then the cut one."""
    decoder = json.JSONDecoder()
    text = text.strip()
    pos = 1 if text.startswith("[") else 0
    calls: list[ToolCall] = []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n;,":
            pos += 1
        if pos >= len(text):
            return calls
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            partial = _partial_json_call(text[pos:], names)
            return [*calls, partial] if partial is not None else calls
        call = _call_from(value, names)
        if call is None:
            return calls
        calls.append(call)


def partial_mistral_calls(text: str, names: frozenset[str]) -> list[ToolCall]:
    """``[TOOL_CALLS]`` text the output ended inside, either form."""
    if text.lstrip().startswith(("[", "{")):
        return partial_json_calls(text, names)
    calls: list[ToolCall] = []
    for segment in [s for s in text.split(MISTRAL_CALLS) if s.strip()]:
        head, sep, args = segment.partition(MISTRAL_ARGS)
        if not sep:
            head = head[: len(head) - _held_suffix(head, (MISTRAL_ARGS, MISTRAL_CALL_ID))]
        name = known_name(head.partition(MISTRAL_CALL_ID)[0].strip(), names, whole=bool(sep))
        if name is None:
            break
        whole = _call_from({"name": name, "arguments": args.strip()}, names) if sep else None
        calls.append(whole or ToolCall(name, args.strip(), complete=False))
    return calls


def _unfenced(args: str) -> str:
    """Arguments less the opening of their json fence, even one cut short."""
    args = args.strip()
    if "```json".startswith(args):
        return ""
    for fence in ("```json", "```"):
        if args.startswith(fence):
            return args[len(fence) :].strip()
    return args


def partial_deepseek_calls(text: str, names: frozenset[str]) -> list[ToolCall]:
    """DeepSeek calls the output ended inside: whole ones, then the cut one."""
    body = text.strip().removeprefix(DEEPSEEK_CALLS_BEGIN).partition(DEEPSEEK_CALLS_END)[0]
    body = body[: len(body) - _held_suffix(body, (DEEPSEEK_CALLS_END,))]
    calls: list[ToolCall] = []
    for segment in [s for s in body.split(DEEPSEEK_CALL_BEGIN) if s.strip()]:
        if segment.rstrip().endswith(DEEPSEEK_CALL_END):
            call = _deepseek_call(segment.rstrip().removesuffix(DEEPSEEK_CALL_END), names)
            if call is None:
                break
            calls.append(call)
            continue
        head, sep, rest = segment.partition(DEEPSEEK_SEP)
        if not sep:
            break
        if head.strip() == "function":
            written, newline, args = rest.partition("\n")
        else:
            written, newline, args = rest.partition("{")
            args = newline + args
        name = known_name(written.strip(), names, whole=bool(newline))
        if name is None:
            break
        args = _unfenced(args)
        args = args[: len(args) - _held_suffix(args, ("\n```" + DEEPSEEK_CALL_END, "```" + DEEPSEEK_CALL_END))]
        calls.append(ToolCall(name, _whole_json_prefix(args.rstrip()), complete=False))
    return calls


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
    ) -> None:
        self._thinking = thinking or starts_in_reasoning
        # A grammar forces calls: no visible text can follow, only markup.
        self._forced = forced
        self._names = tool_names
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
                    buf = buf[: len(buf) - _held_suffix(buf, (THINK_CLOSE,))]
                if buf:
                    out.append(Reasoning(buf))
            case _State.TEXT:
                # Under a forced call, what is held back is the start of a marker.
                if not self._forced and (buf.strip() or (buf and not self._fresh)):
                    out.append(Text(buf))
            case _State.HERMES:
                out.extend(self._hermes_calls(buf, closed=False))
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
            case _State.HERMES:
                return self._step_hermes(out)
            case _State.TRAILING_CALLS:
                return False

    def _step_reasoning(self, out: list[Piece]) -> bool:
        if not self._output_started:
            # A template that opens <think> itself may still see the model repeat it.
            stripped = self._buf.lstrip()
            if THINK_OPEN.startswith(stripped) and stripped != THINK_OPEN:
                return False
            if stripped.startswith(THINK_OPEN):
                self._buf = stripped[len(THINK_OPEN) :]
            self._output_started = True
        if self._fresh:
            self._buf = self._buf.lstrip()
        end = self._buf.find(THINK_CLOSE)
        if end >= 0:
            if end:
                out.append(Reasoning(self._buf[:end]))
            self._fresh = False
            self._buf = self._buf[end + len(THINK_CLOSE) :]
            self._enter_text()
            return True
        keep = _held_suffix(self._buf, (THINK_CLOSE,))
        if len(self._buf) > keep:
            out.append(Reasoning(self._buf[: len(self._buf) - keep]))
            self._buf = self._buf[len(self._buf) - keep :]
            self._fresh = False
        return False

    def _markers(self) -> tuple[str, ...]:
        markers: tuple[str, ...] = (THINK_OPEN,) if self._thinking else ()
        if self._names:
            markers += (HERMES_OPEN, MISTRAL_CALLS, PYTHON_TAG, DEEPSEEK_CALLS_BEGIN, DEEPSEEK_CALL_BEGIN)
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
            self._buf = self._buf[pos + len(marker) :]
            self._enter_marker(marker)
            return True
        keep = _held_suffix(self._buf, markers)
        self._emit_text(out, self._buf[: len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep :]
        return False

    def _emit_text(self, out: list[Piece], text: str) -> None:
        if text:
            out.append(Text(text))
            self._fresh = False
            self._visible_started = True

    def _enter_marker(self, marker: str) -> None:
        if marker == THINK_OPEN:
            self._state = _State.REASONING
            self._fresh = True
        elif marker == HERMES_OPEN:
            self._state = _State.HERMES
        else:
            self._state = _State.TRAILING_CALLS
            self._trailing_prefix = marker

    def _enter_text(self) -> None:
        self._state = _State.TEXT
        self._fresh = True

    def _step_hermes(self, out: list[Piece]) -> bool:
        end = self._buf.find(HERMES_CLOSE)
        if end < 0:
            return False
        body = self._buf[:end]
        self._buf = self._buf[end + len(HERMES_CLOSE) :]
        out.extend(self._hermes_calls(body, closed=True))
        self._enter_text()
        return True

    def _hermes_calls(self, body: str, *, closed: bool) -> list[Piece]:
        self._visible_started = True
        # A stop string or the token limit may have cut the closing tag.
        cut = body if closed else body[: len(body) - _held_suffix(body, (HERMES_CLOSE,))]
        calls = parse_json_calls(cut, self._names)
        if calls:
            return list(calls)
        if not closed:
            return list(partial_json_calls(cut, self._names))
        return [Text(HERMES_OPEN + body + HERMES_CLOSE)]

    def _trailing_calls(self, buf: str) -> list[Piece]:
        """Calls run to the end of the output: ones that do not parse were cut short there."""
        prefix = self._trailing_prefix
        if prefix == MISTRAL_CALLS:
            calls = parse_mistral_calls(buf, self._names)
        elif prefix in (DEEPSEEK_CALLS_BEGIN, DEEPSEEK_CALL_BEGIN):
            calls = parse_deepseek_calls(prefix + buf, self._names)
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
        return partial_json_calls(buf, self._names)


# ------------------------------------------------------------------ harmony

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
    keep = _held_suffix(text, (*HARMONY_ENDS, *_HARMONY_BOUNDS))
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
        whole = _call_from({"name": name, "arguments": body.strip()}, self._names)
        return [whole if whole is not None else ToolCall(name, _whole_json_prefix(body.strip()), complete=False)]

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
                keep = _held_suffix(self._buf, (*HARMONY_ENDS, *_HARMONY_BOUNDS))
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
            call = _call_from({"name": name, "arguments": body.strip()}, self._names)
        # Not a call we can make (unknown function, broken arguments): kept as text.
        return call if call is not None else Text(self._header + HARMONY_MESSAGE + body)
