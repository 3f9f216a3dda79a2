"""Conversation items -> the chat messages a model's template renders.

One assistant turn of the Responses API is several items (reasoning, a
message, function calls); chat templates expect one assistant message with
``content``, ``reasoning_content`` and ``tool_calls``. Items of one turn are
merged here; a ``function_call_output`` becomes a ``tool`` message naming its
call. ``developer`` maps to ``system``, which every template knows.
"""

from __future__ import annotations

import json
from typing import Any

from supervisor.errors import BadRequest
from supervisor.generation.images import Images, decode_data_url
from supervisor.generation.tools import FunctionTool
from supervisor.responses.items import (
    CodeInterpreterCallItem,
    FileSearchCallItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputImage,
    Item,
    McpApprovalRequestItem,
    McpApprovalResponseItem,
    McpCallItem,
    McpListToolsItem,
    MessageItem,
    ReasoningItem,
    WebSearchCallItem,
    image_data,
)
from worker.protocol import ChatMessage, ContentPart, ImagePart, TextPart


class _Turns:
    """Accumulates chat messages, merging consecutive assistant items."""

    def __init__(self) -> None:
        self.messages: list[ChatMessage] = []
        self.call_names: dict[str, str] = {}
        self._pending_reasoning: list[str] = []

    def _assistant(self) -> ChatMessage:
        last = self.messages[-1] if self.messages else None
        if last is not None and last.role == "assistant":
            return last
        msg = ChatMessage(role="assistant", content="")
        self.messages.append(msg)
        return msg

    def _take_reasoning(self, msg: ChatMessage) -> None:
        if self._pending_reasoning:
            msg.reasoning_content = (msg.reasoning_content or "") + "".join(self._pending_reasoning)
            self._pending_reasoning = []

    def add_message(self, item: MessageItem) -> None:
        if item.role == "assistant":
            msg = self._assistant()
            if msg.tool_calls:
                # Text after tool calls of the same turn starts a new message.
                msg = ChatMessage(role="assistant", content="")
                self.messages.append(msg)
            msg.content = (msg.content or "") + item.text()
            self._take_reasoning(msg)
            return
        role = "system" if item.role == "developer" else item.role
        msg = ChatMessage(role=role, content=item.text())
        if item.images():
            # Validation allows images in user messages only, so moving system
            # messages first never reorders them.
            msg.parts = _parts(item)
        self.messages.append(msg)

    def add_call(self, item: FunctionCallItem) -> None:
        msg = self._assistant()
        self._take_reasoning(msg)
        name = item.offered_name
        call = {"id": item.call_id, "type": "function", "function": {"name": name, "arguments": item.arguments}}
        msg.tool_calls = [*(msg.tool_calls or []), call]
        self.call_names[item.call_id] = name

    def add_output(self, item: FunctionCallOutputItem, param: str | None) -> None:
        name = self.call_names.get(item.call_id)
        if name is None:
            raise BadRequest(
                f"no function_call with call_id {item.call_id!r} precedes this function_call_output",
                param=param,
                code="invalid_call_id",
            )
        self.messages.append(ChatMessage(role="tool", content=item.text(), tool_call_id=item.call_id, name=name))

    def add_hosted_call(self, item: McpCallItem | CodeInterpreterCallItem | WebSearchCallItem
                        | FileSearchCallItem) -> None:
        """A call the server ran: the assistant's call, then its result, as for a function."""
        msg = self._assistant()
        self._take_reasoning(msg)
        # The functions the model was offered (responses/hosted/code_interpreter.py, web_search.py,
        # file_search.py).
        if isinstance(item, CodeInterpreterCallItem):
            name, arguments = "code_interpreter", json.dumps({"code": item.code or ""})
        elif isinstance(item, WebSearchCallItem):
            name, arguments = "web_search", json.dumps({"query": item.action.query or ""})
        elif isinstance(item, FileSearchCallItem):
            name, arguments = "file_search", json.dumps({"queries": item.queries})
        else:
            name, arguments = item.name, item.arguments
        call = {"id": item.id, "type": "function", "function": {"name": name, "arguments": arguments}}
        msg.tool_calls = [*(msg.tool_calls or []), call]
        self.messages.append(ChatMessage(role="tool", content=item.result_text(), tool_call_id=item.id, name=name))

    def add_approval_request(self, item: McpApprovalRequestItem) -> None:
        """A call that waited for approval: the assistant's call; its result
        comes with the answer (the run call's output, or the refusal)."""
        msg = self._assistant()
        self._take_reasoning(msg)
        call = {"id": item.id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
        msg.tool_calls = [*(msg.tool_calls or []), call]
        self.call_names[item.id] = item.name

    def add_result(self, call_id: str, text: str) -> None:
        """The result of a call the assistant made earlier (an approved or refused one)."""
        self.messages.append(ChatMessage(role="tool", content=text, tool_call_id=call_id,
                                         name=self.call_names.get(call_id)))

    def add_reasoning(self, item: ReasoningItem) -> None:
        self._pending_reasoning.append(item.text())


def to_messages(
    history: list[Item],
    items: list[Item],
    instructions: str | None,
) -> list[ChatMessage]:
    """Chat messages for ``instructions`` + stored ``history`` + this request's ``items``.

    Errors about ``items`` name their index (``input[i].call_id``); history
    was validated when it was stored.
    """
    turns = _Turns()
    if instructions:
        turns.messages.append(ChatMessage(role="system", content=instructions))
    n_history = len(history)
    for pos, item in enumerate([*history, *items]):
        param = f"input[{pos - n_history}].call_id" if pos >= n_history else None
        match item:
            case MessageItem():
                turns.add_message(item)
            case FunctionCallItem():
                turns.add_call(item)
            case FunctionCallOutputItem():
                turns.add_output(item, param)
            case ReasoningItem():
                turns.add_reasoning(item)
            case McpCallItem() if item.approval_request_id in turns.call_names:
                turns.add_result(item.approval_request_id, item.result_text())  # its call was the request
            case McpCallItem() | CodeInterpreterCallItem() | WebSearchCallItem() | FileSearchCallItem():
                turns.add_hosted_call(item)
            case McpApprovalRequestItem():
                turns.add_approval_request(item)
            case McpApprovalResponseItem():
                if not item.approve and item.approval_request_id in turns.call_names:
                    turns.add_result(item.approval_request_id, item.denial_text())
                # Approved: the mcp_call naming the request follows with its output.
            case McpListToolsItem():
                pass  # the tools it lists are offered as functions, not rendered as a turn
    return _system_first(turns.messages)


def _parts(item: MessageItem) -> list[ContentPart]:
    assert not isinstance(item.content, str)
    return [ImagePart() if isinstance(p, InputImage) else TextPart(p.text) for p in item.content]


def first_image(history: list[Item], items: list[Item]) -> str | None:
    """The field of the first image of stored ``history`` and ``items``
    (as :func:`collect_images` names it), None without one; nothing decoded."""
    n_history = len(history)
    for pos, item in enumerate([*history, *items]):
        if not isinstance(item, MessageItem) or isinstance(item.content, str):
            continue
        for j, part in enumerate(item.content):
            if isinstance(part, InputImage):
                return f"input[{pos - n_history}].content[{j}]" if pos >= n_history else "previous_response_id"
    return None


def collect_images(history: list[Item], items: list[Item]) -> Images:
    """The images of stored ``history`` and this request's ``items``, in the
    order their messages place them. A request's own images were decoded when
    it was validated; stored ones (validated when stored) are decoded here."""
    images = Images()
    n_history = len(history)
    for pos, item in enumerate([*history, *items]):
        if not isinstance(item, MessageItem) or isinstance(item.content, str):
            continue
        for j, part in enumerate(item.content):
            if not isinstance(part, InputImage):
                continue
            param = f"input[{pos - n_history}].content[{j}]" if pos >= n_history else "previous_response_id"
            data = image_data(part)
            if data is None:
                data = decode_data_url(part.image_url or "", param)
            images.add_decoded(data, param)
    return images


def _system_first(messages: list[ChatMessage]) -> list[ChatMessage]:
    """Merge every system message into one leading message.

    Many templates accept a system message only in first position; the
    instructions and any system/developer items are joined there, in order.
    """
    systems = [m.content or "" for m in messages if m.role == "system"]
    rest = [m for m in messages if m.role != "system"]
    if not systems:
        return rest
    return [ChatMessage(role="system", content="\n\n".join(systems)), *rest]


def template_tools(tools: list[FunctionTool]) -> list[dict[str, Any]]:
    """Flat Responses tools -> the nested chat-completions form templates expect."""
    out: list[dict[str, Any]] = []
    for tool in tools:
        fn: dict[str, Any] = {"name": tool.name, "parameters": tool.parameters or {"type": "object", "properties": {}}}
        if tool.description:
            fn["description"] = tool.description
        out.append({"type": "function", "function": fn})
    return out
