"""The Response object, shaped as the official SDK's ``Response`` type."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from supervisor.generation.tools import FunctionTool, NamespaceTool, ToolChoice, echoed
from supervisor.responses.items import Item, new_id
from supervisor.responses.models import CreateRequest, ReasoningConfig, TextConfig

Status = Literal["completed", "incomplete", "failed", "in_progress", "queued", "cancelled"]
TERMINAL: frozenset[str] = frozenset({"completed", "incomplete", "failed", "cancelled"})


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class Usage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens_details: OutputTokensDetails

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int, reasoning: int) -> Usage:
        return cls(
            input_tokens=prompt,
            output_tokens=completion,
            total_tokens=prompt + completion,
            input_tokens_details=InputTokensDetails(cached_tokens=cached),
            output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning),
        )


# OpenAI's ResponseError.code is a closed list that strict clients validate;
# our own code (worker_crashed, evicted, queue_full, ...) goes in ``cause``.
_RATE_LIMITED = frozenset({"queue_full", "no_capacity", "rate_limited"})
_BAD_PROMPT = frozenset({"context_length_exceeded", "invalid_grammar", "template_error", "invalid_request"})


class ErrorInfo(msgspec.Struct):
    code: str
    message: str
    cause: str | None = None

    @classmethod
    def of(cls, cause: str, message: str) -> ErrorInfo:
        if cause in _RATE_LIMITED:
            code = "rate_limit_exceeded"
        elif cause in _BAD_PROMPT:
            code = "invalid_prompt"
        else:
            code = "server_error"
        return cls(code=code, message=message, cause=cause)


class IncompleteDetails(msgspec.Struct):
    # OpenAI's reasons, and ours: the request's time limit (request_timeout_s) ended it.
    reason: Literal["max_output_tokens", "content_filter", "request_timeout"]


class ResponseObject(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Status
    model: str
    output: list[Item] = []
    error: ErrorInfo | None = None
    incomplete_details: IncompleteDetails | None = None
    usage: Usage | None = None
    completed_at: int | None = None
    # Echoed request parameters (the SDK type requires several of them).
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    parallel_tool_calls: bool = True
    tool_choice: ToolChoice = "auto"
    tools: list[FunctionTool | NamespaceTool] = []
    temperature: float = 1.0
    top_p: float = 1.0
    reasoning: ReasoningConfig | None = None
    text: TextConfig = msgspec.field(default_factory=TextConfig)
    truncation: Literal["auto", "disabled"] = "disabled"
    top_logprobs: int | None = None
    metadata: dict[str, str] = {}
    user: str | None = None
    store: bool = True
    background: bool = False
    service_tier: str = "default"

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL


def new_response(req: CreateRequest, created_at: float, status: Status) -> ResponseObject:
    return ResponseObject(
        id=new_id("resp"),
        created_at=int(created_at),
        status=status,
        model=req.model,
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        previous_response_id=req.previous_response_id,
        parallel_tool_calls=req.parallel_tool_calls,
        tool_choice=req.tool_choice,
        tools=echoed(req.tools),
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        reasoning=req.reasoning,
        text=req.text,
        metadata=dict(req.metadata or {}),
        user=req.user,
        store=req.store,
        background=req.background,
        truncation=req.truncation or "disabled",
        top_logprobs=req.top_logprobs,
    )


def snapshot(resp: ResponseObject, **changes: Any) -> ResponseObject:
    """A shallow copy with the output list copied, for events sent mid-stream."""
    return msgspec.structs.replace(resp, output=list(resp.output), **changes)
