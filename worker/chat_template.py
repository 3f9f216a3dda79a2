"""Render chat prompts with the model's own Jinja2 chat template.

Templates run in a sandboxed environment with the helpers Hugging Face
templates expect (``raise_exception``, ``strftime_now``, a JSON-faithful
``tojson``). A model without a template is prompted in ChatML (the same
fallback llama.cpp uses), and ``<|im_end|>`` is then a stop string.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.sandbox

from worker.protocol import ChatMessage

CHATML_FALLBACK = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
FALLBACK_STOPS = ["<|im_end|>", "<|im_start|>"]


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


class ChatRenderer:
    def __init__(self, template: str | None, bos_token: str, eos_token: str) -> None:
        self.is_fallback = template is None
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, undefined=jinja2.Undefined
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        self._template = env.from_string(template or CHATML_FALLBACK)
        self._bos = bos_token
        self._eos = eos_token

    @property
    def extra_stops(self) -> list[str]:
        return list(FALLBACK_STOPS) if self.is_fallback else []

    def render(
        self,
        messages: list[ChatMessage],
        tools: list[dict[str, Any]] | None = None,
        variables: dict[str, Any] | None = None,
    ) -> str:
        payload = [_message_dict(m) for m in messages]
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
        # The tokenizer adds BOS itself; a template that also writes it would double it.
        if self._bos and text.startswith(self._bos):
            text = text[len(self._bos) :]
        return text


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


def _message_dict(msg: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": msg.role, "content": msg.content if msg.content is not None else ""}
    if msg.tool_calls:
        out["tool_calls"] = [_template_call(call) for call in msg.tool_calls]
    if msg.tool_call_id is not None:
        out["tool_call_id"] = msg.tool_call_id
    if msg.name is not None:
        out["name"] = msg.name
    if msg.reasoning_content is not None:
        out["reasoning_content"] = msg.reasoning_content
    return out
