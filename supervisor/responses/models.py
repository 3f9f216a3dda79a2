"""The ``POST /v1/responses`` request body, decoded strictly.

Every field the API defines is declared; a value we cannot honour is a 400
naming the field (never silently ignored). Unknown *fields* are ignored, so
newer clients and echoed-back items (``id``, ``status``, ``phase``) work.
Input items are decoded one by one after the body, because a message may come
without ``type``; their errors are re-labelled ``input[i].field``.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec

from supervisor.api.io import validation_param
from supervisor.errors import BadRequest
from supervisor.generation.images import Images
from supervisor.generation.template_vars import checked_kwargs
from supervisor.generation.tools import (
    FunctionTool,
    Offer,
    RequestTool,
    ToolChoice,
    offer,
    runs_here,
)
from supervisor.responses.items import (
    InputImage,
    Item,
    MessageItem,
    keep_image_data,
    normalize,
)
from supervisor.responses.logprobs import MAX_TOP_LOGPROBS

# FunctionTool is also importable from here, where it lived before tools.py.
__all__ = ["CreateRequest", "Effort", "FunctionTool", "ValidRequest", "decode_items", "validate"]

Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class ReasoningConfig(msgspec.Struct, kw_only=True):
    effort: Effort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class FormatText(msgspec.Struct, tag="text", tag_field="type"):
    pass


class FormatJsonObject(msgspec.Struct, tag="json_object", tag_field="type"):
    pass


class FormatJsonSchema(msgspec.Struct, tag="json_schema", tag_field="type", kw_only=True):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    schema: dict[str, Any]
    description: str | None = None
    strict: bool | None = None


TextFormat = FormatText | FormatJsonObject | FormatJsonSchema


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat = msgspec.field(default_factory=FormatText)
    verbosity: Literal["low", "medium", "high"] | None = None


# Reasoning is never encrypted here (nothing is withheld), so asking for it
# changes nothing; output-text logprobs are computed by the worker.
Includable = Literal["reasoning.encrypted_content", "message.output_text.logprobs",
                     # Hosted tools' items always carry these here.
                     "code_interpreter_call.outputs", "web_search_call.action.sources", "web_search_call.results",
                     # Asked for, a file_search_call keeps the chunks it found (else the model alone reads them).
                     "file_search_call.results"]

Metadata = Annotated[
    dict[Annotated[str, msgspec.Meta(max_length=64)], Annotated[str, msgspec.Meta(max_length=512)]],
    msgspec.Meta(max_length=16),
]


class CreateRequest(msgspec.Struct, kw_only=True):
    model: Annotated[str, msgspec.Meta(min_length=1)]
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    tools: list[RequestTool] = []
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    background: bool = False
    max_output_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig = msgspec.field(default_factory=TextConfig)
    metadata: Metadata | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    # Accepted because clients send them; they change nothing locally.
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    stream_options: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    include: list[Includable] | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # Extension shared with our chat completions: generate to max_output_tokens.
    ignore_eos: bool = False
    # Extension shared with our chat completions: a <base>:<adapter> model's adapter scale.
    lora_scale: float | None = None
    # Extensions shared with our chat completions: chat template variables,
    # and the shortcut for enable_thinking (supervisor/generation/template_vars.py).
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: bool | None = None
    # Hosted features with no local meaning: any value but null is a 400.
    conversation: None = None
    prompt: None = None


class ValidRequest(msgspec.Struct, kw_only=True):
    """A request after cross-field checks, with input items normalized."""

    body: CreateRequest
    items: list[Item]
    # The functions offered to the model under the resolved tool_choice.
    offer: Offer = msgspec.field(default_factory=Offer)
    # Who asked (supervisor/api/callers.py), set by the route: crashes are blamed on it.
    caller: str = ""


_item_decoder_type: Any = Item
# msgspec reports a missing field on its parent ("... field `call_id`"); the
# client is better served by the field's own path.
_MISSING = re.compile(r"missing required field `([^`]+)`")


def item_param(exc: msgspec.ValidationError, index: int) -> str:
    path = [f"input[{index}]"]
    sub = validation_param(exc)
    if sub:
        path.append(sub)
    missing = _MISSING.search(str(exc))
    if missing:
        path.append(missing.group(1))
    return ".".join(path)


def _decode_item(raw: Any, index: int) -> Item:
    if isinstance(raw, dict) and "type" not in raw and "role" in raw:
        raw = {**raw, "type": "message"}
    try:
        item: Item = msgspec.convert(raw, _item_decoder_type)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid input item {index}: {exc}", param=item_param(exc, index)) from exc
    return normalize(item)


def decode_items(value: str | list[dict[str, Any]] | None) -> list[Item]:
    if value is None:
        return []
    if isinstance(value, str):
        return [normalize(MessageItem(role="user", content=value))]
    return [_decode_item(raw, i) for i, raw in enumerate(value)]


def check_images(items: list[Item]) -> None:
    """Decode each input_image of ``items`` once, keeping the bytes on its part;
    a 400 names the part (``input[i].content[j]``)."""
    images = Images()
    for i, item in enumerate(items):
        if not isinstance(item, MessageItem) or isinstance(item.content, str):
            continue
        for j, part in enumerate(item.content):
            if not isinstance(part, InputImage):
                continue
            param = f"input[{i}].content[{j}]"
            if item.role != "user":
                raise BadRequest("images are accepted in user messages only", param=param)
            if part.file_id is not None:
                raise BadRequest("file_id images are not supported (no files are stored here): "
                                 "send the image as a base64 data: URL in image_url", param=param)
            if part.image_url is None:
                raise BadRequest("an input_image needs image_url (a base64 data: URL)",
                                 param=param)
            images.add(part.image_url, param)
            keep_image_data(part, images.data[-1])


def validate(body: CreateRequest) -> ValidRequest:
    """Cross-field rules msgspec cannot express; raises BadRequest naming the field."""
    items = decode_items(body.input)
    check_images(items)
    if not items and body.previous_response_id is None:
        raise BadRequest("input is required", param="input")
    # Hosted tools are known once they are set up (an MCP server listed, a
    # container found; responses/hosted/): the choice is resolved then.
    hosted = any(runs_here(t) for t in body.tools)
    offered = offer(body.tools, "auto" if hosted else body.tool_choice)
    checked_kwargs(body.chat_template_kwargs, body.enable_thinking)
    if body.background and not body.store:
        raise BadRequest("background responses must be stored (store: true)", param="background")
    return ValidRequest(body=body, items=items, offer=offered)
