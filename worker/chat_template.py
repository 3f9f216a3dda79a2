"""Render chat prompts with the model's own Jinja2 chat template.

Templates run in a sandboxed environment with the helpers Hugging Face
templates expect (``raise_exception``, ``strftime_now``, a JSON-faithful
``tojson``, ``{% break %}`` / ``{% continue %}``). A model without a template
gets a built-in template for its architecture, else ChatML (chosen in
formats/chat_templates.py), whose turn markers are then stop strings too.

Some published templates make demands of the conversation that OpenAI
clients do not meet; :class:`_Quirks` adapts the messages to them (call ids
of nine characters, a null content beside tool calls, reasoning under the
name ``thinking``).
"""

from __future__ import annotations

import hashlib
import json
import re
import string
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.sandbox

from pathlib import Path

from formats.chat_templates import CHATML_FALLBACK, FALLBACK_STOPS, ChosenTemplate, read_template_file
from worker.protocol import MEDIA_MARKER, ChatMessage, TextPart

# Mistral's templates refuse any tool call id that is not nine alphanumerics.
_NINE_CHAR_IDS = re.compile(r"""id['"\]]*\s*\|\s*length\s*!=\s*9""")
# A template that tells a missing content from an empty one (DeepSeek-R1
# renders an assistant turn's tool calls only when its content is none).
_NULL_CONTENT = re.compile(r"""message(?:\.content|\[['"]content['"]\])\s+is\s+(?:not\s+)?none""")
_ID_ALPHABET = string.ascii_letters + string.digits


class TemplateError(Exception):
    """The template refused the conversation (e.g. roles must alternate)."""


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Undefined(jinja2.Undefined):
    """Jinja's undefined, except that ``+`` with a string is that string.

    ``~`` already joins an undefined value as ""; templates that join an
    optional field with ``+`` (gpt-oss: ``"// " + tool.description``) would
    otherwise fail for a tool sent without a description.
    """

    def __add__(self, other: object) -> Any:
        if isinstance(other, str):
            return other
        return self._fail_with_undefined_error()

    def __radd__(self, other: object) -> Any:
        if isinstance(other, str):
            return other
        return self._fail_with_undefined_error()


class ChatRenderer:
    """Renders with ``template``; None is the ChatML fallback. ``stops`` end
    a generation as text (None: the fallback's, for the fallback only)."""

    def __init__(self, template: str | None, bos_token: str, eos_token: str,
                 stops: tuple[str, ...] | None = None) -> None:
        self._stops = stops if stops is not None else FALLBACK_STOPS if template is None else ()
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, undefined=_Undefined, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        self._template = env.from_string(template or CHATML_FALLBACK)
        self._quirks = _Quirks.of(template or "")
        self._bos = bos_token
        self._eos = eos_token

    @classmethod
    def of(cls, chosen: ChosenTemplate, bos_token: str, eos_token: str) -> ChatRenderer:
        return cls(chosen.text, bos_token, eos_token, chosen.stops)

    @property
    def extra_stops(self) -> list[str]:
        return list(self._stops)

    def render(
        self,
        messages: list[ChatMessage],
        tools: list[dict[str, Any]] | None = None,
        variables: dict[str, Any] | None = None,
        media_marker: str = MEDIA_MARKER,
    ) -> str:
        """The prompt text; each image part becomes ``media_marker``, where
        the engine puts that image's embeddings (as llama.cpp's own chat path
        does, so templates see string content)."""
        payload = [self._quirks.message_dict(m, media_marker) for m in messages]
        try:
            text = self._template.render(
                messages=payload,
                tools=tools,
                add_generation_prompt=True,
                bos_token=self._bos,
                eos_token=self._eos,
                **(variables or {}),
            )
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template failed: {exc}") from exc
        except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as exc:
            # Python errors inside the template (e.g. a string joined with a
            # none): the conversation does not fit it, which is the client's to fix.
            raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
        # The tokenizer adds BOS itself; a template that also writes it would double it.
        if self._bos and text.startswith(self._bos):
            text = text[len(self._bos) :]
        return text


def override_template(path: str) -> str | None:
    """The text of a model's chat_template_file setting (None when unset).
    The parent checked the file; read again here, one changed since raises
    ``TemplateFileError``."""
    return read_template_file(Path(path)) if path else None


class _Arguments(dict[str, Any]):
    """A tool call's JSON arguments as templates want them either way.

    OpenAI clients send ``arguments`` as a JSON string; Hugging Face templates
    expect a mapping and often apply ``tojson`` (a string would be encoded
    twice), while others print it as is. This is the mapping, and prints as
    the client's original JSON text.
    """

    def __init__(self, value: dict[str, Any], text: str) -> None:
        super().__init__(value)
        self.text = text

    def __str__(self) -> str:
        return self.text

    # Templates that join the arguments with ``+`` (DeepSeek-R1) get the text.
    def __add__(self, other: object) -> str:
        if isinstance(other, str):
            return self.text + other
        return NotImplemented

    def __radd__(self, other: object) -> str:
        if isinstance(other, str):
            return other + self.text
        return NotImplemented


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        value = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call  # not JSON: the template gets the text unchanged
    if not isinstance(value, dict):
        return call
    return {**call, "function": {**function, "arguments": _Arguments(value, function["arguments"])}}


def _nine_char_id(call_id: str) -> str:
    """A stable nine-alphanumeric id for ``call_id``: the same id maps the
    same way in every turn, so a call and its result stay paired."""
    if len(call_id) == 9 and call_id.isascii() and call_id.isalnum():
        return call_id
    n = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    chars = []
    for _ in range(9):
        n, digit = divmod(n, len(_ID_ALPHABET))
        chars.append(_ID_ALPHABET[digit])
    return "".join(chars)


@dataclass(frozen=True)
class _Quirks:
    """How one template wants the messages, read from its text."""

    nine_char_ids: bool = False
    null_content: bool = False

    @classmethod
    def of(cls, template: str) -> _Quirks:
        return cls(nine_char_ids=bool(_NINE_CHAR_IDS.search(template)),
                   null_content=bool(_NULL_CONTENT.search(template)))

    def _call_id(self, call_id: str) -> str:
        return _nine_char_id(call_id) if self.nine_char_ids else call_id

    def _call(self, call: dict[str, Any]) -> dict[str, Any]:
        call = _template_call(call)
        if isinstance(call.get("id"), str):
            call = {**call, "id": self._call_id(call["id"])}
        return call

    def message_dict(self, msg: ChatMessage, media_marker: str = MEDIA_MARKER) -> dict[str, Any]:
        # Most templates join content as a string, so a missing one is "".
        content: str | None = msg.content if msg.content is not None else ""
        if msg.parts is not None:
            content = "".join(p.text if isinstance(p, TextPart) else media_marker for p in msg.parts)
        if self.null_content and msg.tool_calls and not content:
            content = None
        out: dict[str, Any] = {"role": msg.role, "content": content}
        if msg.tool_calls:
            out["tool_calls"] = [self._call(call) for call in msg.tool_calls]
        if msg.tool_call_id is not None:
            out["tool_call_id"] = self._call_id(msg.tool_call_id)
        if msg.name is not None:
            out["name"] = msg.name
        if msg.reasoning_content is not None:
            out["reasoning_content"] = msg.reasoning_content
            # gpt-oss reads reasoning as "thinking", and refuses a tool-call
            # turn that has both it and content: the content is kept then.
            if not (msg.tool_calls and content):
                out["thinking"] = msg.reasoning_content
        return out
