"""Conversation items: the one shape used for input, output and storage.

Input items arrive in the loose forms clients send (a message without
``type``, string content, no ids) and are normalized into these Structs; output
items are built in the same Structs; both are stored as JSON and served back by
``GET /v1/responses/{id}`` and ``/input_items`` exactly as encoded here, so the
shapes follow the official SDK types (``ResponseOutputMessage``,
``ResponseInputMessageItem``, ``ResponseFunctionToolCall``, ...).
"""

from __future__ import annotations

import secrets
from typing import Any, Literal

import msgspec

ItemStatus = Literal["in_progress", "completed", "incomplete"]


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


# ------------------------------------------------------------- content parts


class InputText(msgspec.Struct, tag="input_text", tag_field="type"):
    text: str


class OutputText(msgspec.Struct, tag="output_text", tag_field="type"):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class SummaryText(msgspec.Struct, tag="summary_text", tag_field="type"):
    text: str


class ReasoningText(msgspec.Struct, tag="reasoning_text", tag_field="type"):
    text: str


class InputImage(msgspec.Struct, tag="input_image", tag_field="type", kw_only=True, dict=True):
    """An image of a user message, stored as sent (a base64 data: URL), so a
    continued conversation sends it again. ``detail`` is accepted and ignored.
    ``dict=True`` lets the decoded bytes ride along (:func:`image_data`)
    without being stored."""

    image_url: str | None = None
    file_id: str | None = None
    detail: str = "auto"


ContentPart = InputText | OutputText | InputImage


def image_data(part: InputImage) -> bytes | None:
    """The bytes decoded when the request was validated, if they were."""
    data = part.__dict__.get("data")
    return data if isinstance(data, bytes) else None


def keep_image_data(part: InputImage, data: bytes) -> None:
    part.__dict__["data"] = data


# --------------------------------------------------------------------- items


class MessageItem(msgspec.Struct, tag="message", tag_field="type", kw_only=True):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str = ""
    status: ItemStatus = "completed"

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if not isinstance(part, InputImage))

    def images(self) -> list[InputImage]:
        return [] if isinstance(self.content, str) else [p for p in self.content if isinstance(p, InputImage)]


class FunctionCallItem(msgspec.Struct, tag="function_call", tag_field="type", kw_only=True):
    call_id: str
    name: str
    arguments: str
    id: str = ""
    status: ItemStatus = "completed"
    # The namespace tool the function belongs to (None for a plain function).
    namespace: str | None = None

    @property
    def offered_name(self) -> str:
        """The name the model was offered: namespaced functions are ``namespace.name``."""
        return f"{self.namespace}.{self.name}" if self.namespace else self.name


class FunctionCallOutputItem(msgspec.Struct, tag="function_call_output", tag_field="type", kw_only=True):
    call_id: str
    output: str | list[InputText]
    id: str = ""
    status: ItemStatus = "completed"

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


class ReasoningItem(msgspec.Struct, tag="reasoning", tag_field="type", kw_only=True):
    summary: list[SummaryText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    id: str = ""
    status: ItemStatus = "completed"

    def text(self) -> str:
        parts = self.content if self.content else self.summary
        return "".join(part.text for part in parts)


class McpToolInfo(msgspec.Struct, kw_only=True):
    """One tool an MCP server lists, as the SDK's ``McpListToolsTool``."""

    name: str
    input_schema: Any
    description: str | None = None
    annotations: Any = None


class McpListToolsItem(msgspec.Struct, tag="mcp_list_tools", tag_field="type", kw_only=True):
    """The tools an MCP server offered (supervisor/responses/hosted/)."""

    server_label: str
    tools: list[McpToolInfo]
    error: str | None = None
    id: str = ""


class McpCallItem(msgspec.Struct, tag="mcp_call", tag_field="type", kw_only=True):
    """A call the server ran on an MCP server, with its output or error.
    ``error`` is one of the SDK's ``McpToolCallError`` shapes."""

    server_label: str
    name: str
    arguments: str
    output: str | None = None
    error: dict[str, Any] | None = None
    status: Literal["in_progress", "completed", "incomplete", "calling", "failed"] = "completed"
    approval_request_id: str | None = None
    id: str = ""

    def result_text(self) -> str:
        """What the model reads back: the output, else what went wrong."""
        if self.output is not None:
            return self.output
        if self.error is not None:
            return f"error: {self.error.get('message') or self.error.get('content') or self.error}"
        return "error: the call did not finish"


class McpApprovalRequestItem(msgspec.Struct, tag="mcp_approval_request", tag_field="type", kw_only=True):
    """A call the model made that waits for the user's approval
    (``require_approval``); the response ends with it."""

    server_label: str
    name: str
    arguments: str
    id: str = ""


class McpApprovalResponseItem(msgspec.Struct, tag="mcp_approval_response", tag_field="type", kw_only=True):
    """The user's answer to an approval request: approved, the call runs
    when the conversation goes on; denied, the model is told."""

    approval_request_id: str
    approve: bool
    reason: str | None = None
    id: str = ""

    def denial_text(self) -> str:
        """What the model reads for a call the user did not approve."""
        why = f" ({self.reason})" if self.reason else ""
        return f"error: the user did not approve this call{why}; it did not run"


class CodeLogs(msgspec.Struct, tag="logs", tag_field="type"):
    logs: str


class CodeImage(msgspec.Struct, tag="image", tag_field="type"):
    url: str


CodeStatus = Literal["in_progress", "completed", "incomplete", "interpreting", "failed"]


class CodeInterpreterCallItem(msgspec.Struct, tag="code_interpreter_call", tag_field="type", kw_only=True):
    """Python the server ran in a sandbox container (responses/hosted/),
    as the SDK's ``ResponseCodeInterpreterToolCall``."""

    container_id: str
    code: str | None = None
    outputs: list[CodeLogs | CodeImage] | None = None
    status: CodeStatus = "completed"
    id: str = ""

    def result_text(self) -> str:
        """What the model reads back: the logs (images are named in them)."""
        if self.outputs:
            logs = "".join(o.logs for o in self.outputs if isinstance(o, CodeLogs))
            images = sum(isinstance(o, CodeImage) for o in self.outputs)
            shown = f"[{images} image(s) shown to the user]\n" if images else ""
            return (logs + shown) or "(no output)"
        if self.status == "failed":
            return "error: the code could not be run"
        return "error: the call did not finish"


class SearchSource(msgspec.Struct, tag="url", tag_field="type"):
    url: str


class SearchResult(msgspec.Struct, kw_only=True):
    """One result a search handed the model; ``n`` is the number it was shown
    under (and may cite as ``[n]``), counted over the whole conversation."""

    n: int
    url: str
    title: str = ""
    snippet: str = ""


class SearchAction(msgspec.Struct, tag="search", tag_field="type", kw_only=True):
    query: str | None = None
    sources: list[SearchSource] | None = None


class WebSearchCallItem(msgspec.Struct, tag="web_search_call", tag_field="type", kw_only=True):
    """A search the server ran through its provider (responses/hosted/), as
    the SDK's ``ResponseFunctionWebSearch``; ``results`` (what
    ``include: ["web_search_call.results"]`` names) is what the model read."""

    action: SearchAction
    status: Literal["in_progress", "searching", "completed", "failed", "incomplete"] = "completed"
    results: list[SearchResult] | None = None
    id: str = ""

    def result_text(self) -> str:
        """What the model reads back: the numbered results."""
        if self.status == "failed":
            return "error: the search failed; answer without it"
        if not self.results:
            return "no results" if self.status == "completed" else "error: the search did not finish"
        return "\n\n".join(f"[{r.n}] {r.title}\n{r.url}\n{r.snippet}".rstrip() for r in self.results)


class FileSearchResult(msgspec.Struct, kw_only=True):
    """One chunk a file search handed the model, as the SDK's file search
    ``Result``; ``n`` is the number it was shown under (and may cite as
    ``[n]``), counted over the conversation with web_search's results."""

    n: int
    file_id: str
    filename: str
    score: float
    text: str
    attributes: dict[str, str | float | bool] = {}


class FileSearchCallItem(msgspec.Struct, tag="file_search_call", tag_field="type", kw_only=True, dict=True):
    """A knowledge-base search the server ran (responses/hosted/file_search.py),
    as the SDK's ``ResponseFileSearchToolCall``. ``results`` is there when the
    request included ``file_search_call.results``; the model reads them either
    way (:func:`keep_read`), and a later turn rereads only the stored ones."""

    queries: list[str]
    status: Literal["in_progress", "searching", "completed", "incomplete", "failed"] = "completed"
    results: list[FileSearchResult] | None = None
    id: str = ""

    def read(self) -> list[FileSearchResult] | None:
        """What the model read: the results kept on the item, else the stored ones."""
        kept = self.__dict__.get("shown")
        return kept if isinstance(kept, list) else self.results

    def result_text(self) -> str:
        """What the model reads back: the numbered chunks."""
        if self.status == "failed":
            return "error: the search failed; answer without it"
        results = self.read()
        if results is None:
            if self.status == "completed":
                return "(the results of this search were not kept; search again to read them)"
            return "error: the search did not finish"
        if not results:
            return "no results"
        return "\n\n".join(f"[{r.n}] {r.filename}\n{r.text}" for r in results)


def keep_read(item: FileSearchCallItem, results: list[FileSearchResult]) -> None:
    """Keep what the model read on the item without storing it (the request
    did not include the results): the loop's next generation reads them."""
    item.__dict__["shown"] = results


Item = (MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem | McpListToolsItem | McpCallItem
        | CodeInterpreterCallItem | WebSearchCallItem | FileSearchCallItem | McpApprovalRequestItem
        | McpApprovalResponseItem)

_ID_PREFIX: dict[type[Any], str] = {
    MessageItem: "msg",
    FunctionCallItem: "fc",
    FunctionCallOutputItem: "fco",
    ReasoningItem: "rs",
    McpListToolsItem: "mcpl",
    McpCallItem: "mcp",
    CodeInterpreterCallItem: "ci",
    WebSearchCallItem: "ws",
    FileSearchCallItem: "fs",
    McpApprovalRequestItem: "mcpr",
    McpApprovalResponseItem: "mcpa",
}


def normalize(item: Item) -> Item:
    """Give an input item an id and list-form content (the stored shape)."""
    if not item.id:
        item.id = new_id(_ID_PREFIX[type(item)])
    if isinstance(item, MessageItem):
        # Assistant turns hold output_text, every other role input_text, so a
        # stored message always validates as the SDK's input or output message;
        # images keep their place among the parts.
        parts: list[ContentPart] = [InputText(item.content)] if isinstance(item.content, str) else item.content
        text_part = OutputText if item.role == "assistant" else InputText
        item.content = [p if isinstance(p, InputImage) else text_part(p.text) for p in parts]
    return item


_items_encoder = msgspec.json.Encoder()
_items_decoder = msgspec.json.Decoder(list[Item])
_item_decoder = msgspec.json.Decoder(Item)


def encode_items(items: list[Item]) -> bytes:
    return _items_encoder.encode(items)


def decode_items(data: bytes) -> list[Item]:
    return _items_decoder.decode(data)


def encode_item(item: Item) -> bytes:
    return _items_encoder.encode(item)


def decode_item(data: bytes) -> Item:
    return _item_decoder.decode(data)
