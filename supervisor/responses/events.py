"""The Responses streaming event sequence, built from parsed output pieces.

:class:`EventBuilder` owns the response being generated: it turns
reasoning / text / tool-call pieces into output items and yields each event
as ``(type, JSON bytes)`` with a contiguous ``sequence_number`` from 0. The
order is the one the SDK's stream helper expects:

    response.created, response.in_progress,
    per item: output_item.added,
      message:   content_part.added, output_text.delta*, output_text.done, content_part.done
      reasoning: content_part.added, reasoning_text.delta*, reasoning_text.done, content_part.done
      call:      function_call_arguments.delta, function_call_arguments.done
    output_item.done,
    then exactly one of response.completed / response.incomplete / response.failed.

A background response starts with response.created (queued) and
response.queued when it is accepted, then response.in_progress when it runs.
A call the output ended inside is an ``incomplete`` function_call item.
Non-streaming requests run the same builder and keep only the final object.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, Protocol

import msgspec

from supervisor.generation.pieces import Piece, Reasoning, Text, ToolCall
from supervisor.responses.items import (
    CodeInterpreterCallItem,
    FileSearchCallItem,
    FunctionCallItem,
    Item,
    McpApprovalRequestItem,
    MessageItem,
    OutputText,
    ReasoningItem,
    ReasoningText,
    WebSearchCallItem,
    new_id,
)
from supervisor.responses.logprobs import LogprobEntry
from supervisor.responses.objects import (
    ErrorInfo,
    IncompleteDetails,
    ResponseObject,
    Usage,
    snapshot,
)

_encoder = msgspec.json.Encoder()


class Event(NamedTuple):
    type: str
    data: bytes


class HostedCalls(Protocol):
    """Calls the server runs itself (responses/hosted/): their items, and
    whether some wait to run, which holds the terminal event back."""

    pending: list[Any]

    def owns(self, name: str) -> bool: ...

    def call_item(self, call: ToolCall) -> Any: ...

    def take_pending(self) -> list[Any]: ...

    def annotations(self, text: str) -> list[dict[str, Any]]: ...


class EventBuilder:
    """Builds output items and events for one response."""

    def __init__(self, response: ResponseObject, clock: Callable[[], float] = time.time) -> None:
        self.response = response
        self._clock = clock
        self._seq = 0
        self._open: Item | None = None
        self._open_text: list[str] = []
        self._open_logprobs: list[LogprobEntry] = []
        # Set by queued(): a background response announced itself when it was accepted.
        self._created = False
        # Pre-encoded head and tail of the open item's delta events (hot path).
        self._delta_frame: tuple[str, bytes, bytes] = ("", b"", b"")
        self.hosted: HostedCalls | None = None
        # Usage of the generations before this one (a hosted tool loop runs several).
        self._usage_before: Usage | None = None

    def event(self, type_: str, **fields: Any) -> Event:
        """One event of this response's sequence (the hosted loop's own)."""
        return self._event(type_, **fields)

    def add_item(self, item: Item) -> int:
        """Append an output item; its output_index."""
        self.response.output.append(item)
        return self._index

    def _total(self, usage: Usage | None) -> Usage | None:
        before = self._usage_before
        if before is None or usage is None:
            return usage or before
        return Usage.of(before.input_tokens + usage.input_tokens, before.output_tokens + usage.output_tokens,
                        before.input_tokens_details.cached_tokens + usage.input_tokens_details.cached_tokens,
                        before.output_tokens_details.reasoning_tokens + usage.output_tokens_details.reasoning_tokens)

    def _event(self, type_: str, **fields: Any) -> Event:
        payload = {"type": type_, "sequence_number": self._seq, **fields}
        self._seq += 1
        return Event(type_, _encoder.encode(payload))

    @property
    def _index(self) -> int:
        return len(self.response.output) - 1

    # ------------------------------------------------------------- lifecycle

    def queued(self) -> list[Event]:
        """A background response's first events, when it is accepted (then :meth:`start`)."""
        self.response.status = "queued"
        self._created = True
        return [
            self._event("response.created", response=snapshot(self.response)),
            self._event("response.queued", response=snapshot(self.response)),
        ]

    def start(self) -> list[Event]:
        self.response.status = "in_progress"
        created = [] if self._created else [self._event("response.created", response=snapshot(self.response))]
        self._created = True
        return [*created, self._event("response.in_progress", response=snapshot(self.response))]

    def pieces(self, pieces: list[Piece], logprobs: list[LogprobEntry] | None = None) -> list[Event]:
        """Events for ``pieces``; ``logprobs`` are the tokens of their text."""
        out: list[Event] = []
        for piece in pieces:
            match piece:
                case Reasoning(text):
                    out += self._text_delta(ReasoningItem, text)
                case Text(text):
                    out += self._text_delta(MessageItem, text, logprobs or [])
                    logprobs = None
                case ToolCall():
                    out += self._close()
                    if self.hosted is not None and self.hosted.owns(piece.name):
                        out += self._hosted_call(piece)
                    else:
                        out += self._call(piece)
        return out

    def completed(self, usage: Usage, *, truncated: bool, timed_out: bool = False) -> list[Event]:
        """The terminal event: ``truncated`` by the token limit, or by the
        time limit too when ``timed_out`` (request_timeout_s)."""
        total = self._total(usage)
        assert total is not None
        usage = total
        if not truncated and self.hosted is not None and self.hosted.pending:
            # Calls wait to run: the loop generates again, so no terminal event yet.
            out = self._close()
            self.response.usage = self._usage_before = usage
            return out
        status: Literal["completed", "incomplete"] = "incomplete" if truncated else "completed"
        out = self._close(item_status="incomplete" if truncated else "completed") + self._unrun()
        self.response.usage = usage
        self.response.status = status
        if truncated:
            self.response.incomplete_details = IncompleteDetails(
                reason="request_timeout" if timed_out else "max_output_tokens")
            return out + [self._event("response.incomplete", response=self.response)]
        self.response.completed_at = int(self._clock())
        return out + [self._event("response.completed", response=self.response)]

    def _unrun(self) -> list[Event]:
        """The hosted calls a response ends with before they ran: incomplete."""
        out: list[Event] = []
        for item in self.hosted.take_pending() if self.hosted is not None else []:
            item.status = "incomplete"
            index = self.response.output.index(item)
            out.append(self._event("response.output_item.done", output_index=index, item=item))
        return out

    def failed(self, code: str, message: str, usage: Usage | None = None) -> list[Event]:
        out = self._close(item_status="incomplete") + self._unrun()
        self.response.status = "failed"
        self.response.error = ErrorInfo.of(code, message)
        self.response.usage = self._total(usage)
        return out + [self._event("response.failed", response=self.response)]

    def cancelled(self) -> None:
        """Background cancel: no events are streamed, only the object changes."""
        self._close(item_status="incomplete")
        self.response.status = "cancelled"

    # ----------------------------------------------------------------- items

    def _text_delta(self, kind: type[MessageItem | ReasoningItem], text: str,
                    logprobs: list[LogprobEntry] | None = None) -> list[Event]:
        out: list[Event] = []
        if not isinstance(self._open, kind):
            out += self._close()
            out += self._open_text_item(kind)
        self._open_text.append(text)
        delta_type, head, tail = self._delta_frame
        if logprobs:
            self._open_logprobs += logprobs
            tail = b',"logprobs":' + _encoder.encode(logprobs) + b"}"
        data = b"".join((head, str(self._seq).encode(), b',"delta":', _encoder.encode(text), tail))
        self._seq += 1
        out.append(Event(delta_type, data))
        return out

    def _delta_template(self, kind: type[MessageItem | ReasoningItem], item_id: str) -> None:
        """Pre-encode everything of a delta event but its sequence number and text."""
        is_message = kind is MessageItem
        delta_type = "response.output_text.delta" if is_message else "response.reasoning_text.delta"
        fixed = {"type": delta_type, "item_id": item_id, "output_index": self._index, "content_index": 0}
        head = _encoder.encode(fixed)[:-1] + b',"sequence_number":'
        tail = b',"logprobs":[]}' if is_message else b"}"
        self._delta_frame = (delta_type, head, tail)

    def _open_text_item(self, kind: type[MessageItem | ReasoningItem]) -> list[Event]:
        item: Item
        part: OutputText | ReasoningText
        if kind is MessageItem:
            item = MessageItem(role="assistant", content=[], id=new_id("msg"), status="in_progress")
            part = OutputText("")
        else:
            item = ReasoningItem(summary=[], content=[], id=new_id("rs"), status="in_progress")
            part = ReasoningText("")
        self.response.output.append(item)
        self._open, self._open_text, self._open_logprobs = item, [], []
        self._delta_template(kind, item.id)
        added = msgspec.structs.replace(item)
        return [
            self._event("response.output_item.added", output_index=self._index, item=added),
            self._event(
                "response.content_part.added", item_id=item.id, output_index=self._index, content_index=0, part=part
            ),
        ]

    def _close(self, item_status: Literal["completed", "incomplete"] = "completed") -> list[Event]:
        item = self._open
        if item is None:
            return []
        self._open = None
        text = "".join(self._open_text)
        common = {"item_id": item.id, "output_index": self._index, "content_index": 0}
        out: list[Event] = []
        part: OutputText | ReasoningText
        if isinstance(item, MessageItem):
            # Citations of the hosted tools' results (web_search), once the text is whole.
            annotations = self.hosted.annotations(text) if self.hosted is not None else []
            part = OutputText(text, annotations=annotations, logprobs=list(self._open_logprobs))
            item.content = [part]
            out += [self._event("response.output_text.annotation.added", annotation_index=k, annotation=a, **common)
                    for k, a in enumerate(annotations)]
            out.append(self._event("response.output_text.done", text=text, logprobs=self._open_logprobs, **common))
        else:
            assert isinstance(item, ReasoningItem)
            part = ReasoningText(text)
            item.content = [part]
            out.append(self._event("response.reasoning_text.done", text=text, **common))
        item.status = item_status
        out.append(self._event("response.content_part.done", part=part, **common))
        out.append(self._event("response.output_item.done", output_index=self._index, item=item))
        return out

    def _hosted_call(self, call: ToolCall) -> list[Event]:
        """A call the server runs: its item stays in progress until the loop ran it."""
        assert self.hosted is not None
        item = self.hosted.call_item(call)
        index = self.add_item(item)
        common = {"item_id": item.id, "output_index": index}
        out: list[Event]
        if isinstance(item, McpApprovalRequestItem):
            # Whole at once, as OpenAI streams it: it waits for the user, not for the loop.
            return [self._event("response.output_item.added", output_index=index, item=item),
                    self._event("response.output_item.done", output_index=index, item=item)]
        if isinstance(item, WebSearchCallItem | FileSearchCallItem):
            kind = "web_search_call" if isinstance(item, WebSearchCallItem) else "file_search_call"
            out = [
                self._event("response.output_item.added", output_index=index,
                            item=msgspec.structs.replace(item, status="in_progress")),
                self._event(f"response.{kind}.in_progress", **common),
            ]
        elif isinstance(item, CodeInterpreterCallItem):
            # As OpenAI streams it: the call is in progress, then its code.
            code = item.code or ""
            out = [
                self._event("response.output_item.added", output_index=index,
                            item=msgspec.structs.replace(item, code="", status="in_progress")),
                self._event("response.code_interpreter_call.in_progress", **common),
                self._event("response.code_interpreter_call_code.delta", delta=code, **common),
                self._event("response.code_interpreter_call_code.done", code=code, **common),
            ]
        else:
            out = [
                self._event("response.output_item.added", output_index=index, item=msgspec.structs.replace(item)),
                self._event("response.mcp_call_arguments.delta", delta=call.arguments, **common),
                self._event("response.mcp_call_arguments.done", arguments=call.arguments, **common),
            ]
        if not call.complete:
            out.append(self._event("response.output_item.done", output_index=index, item=item))
        return out

    def _call(self, call: ToolCall) -> list[Event]:
        item = FunctionCallItem(call_id=new_id("call"), name=call.name, arguments="", id=new_id("fc"),
                                status="in_progress", namespace=call.namespace)
        self.response.output.append(item)
        index = self._index
        added = msgspec.structs.replace(item)
        # A call the output ended inside keeps what was written, as an incomplete item.
        item.arguments, item.status = call.arguments, "completed" if call.complete else "incomplete"
        common = {"item_id": item.id, "output_index": index}
        return [
            self._event("response.output_item.added", output_index=index, item=added),
            self._event("response.function_call_arguments.delta", delta=call.arguments, **common),
            self._event("response.function_call_arguments.done", arguments=call.arguments, name=call.name,
                        **common),
            self._event("response.output_item.done", output_index=index, item=item),
        ]
