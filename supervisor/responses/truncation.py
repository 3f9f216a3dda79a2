"""``truncation: "auto"``: drop the oldest conversation items until the prompt fits.

The worker renders the prompt, so the parent counts it from its parts with the
model's own tokenizer: each item's text, the instructions and the tool
definitions, plus a few tokens per item for the markup a template writes
around a message. What the count leaves out (a template's own system text)
is caught by the worker, which refuses a prompt longer than the context
before any prefill; the caller then drops more (:func:`next_drop`).

The budget is the model's context less ``max_output_tokens`` (at most half of
the context), so the answer has room. The instructions are always kept, and
so is the newest item; a tool result whose call was dropped goes with it.
"""

from __future__ import annotations

import json
from typing import Protocol

from supervisor.generation.tools import FunctionTool
from supervisor.responses.convert import template_tools
from supervisor.responses.items import (
    CodeInterpreterCallItem,
    FileSearchCallItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    Item,
    McpApprovalRequestItem,
    McpApprovalResponseItem,
    McpCallItem,
    McpListToolsItem,
    MessageItem,
    ReasoningItem,
    WebSearchCallItem,
)

# Role markers and separators a template writes around one message.
PER_ITEM_TOKENS = 8
# The generation prompt and the template's fixed text around the conversation.
FIXED_TOKENS = 16


class Tokenizer(Protocol):
    async def tokenize(self, model: str, text: str, add_special: bool = True) -> list[int]: ...


def _text(item: Item) -> str:
    match item:
        case MessageItem() | FunctionCallOutputItem() | ReasoningItem():
            return item.text()
        case FunctionCallItem():
            return item.offered_name + item.arguments
        case McpCallItem():
            return item.name + item.arguments + item.result_text()
        case CodeInterpreterCallItem():
            return (item.code or "") + item.result_text()
        case WebSearchCallItem():
            return (item.action.query or "") + item.result_text()
        case FileSearchCallItem():
            return " ".join(item.queries) + item.result_text()
        case McpApprovalRequestItem():
            return item.name + item.arguments
        case McpApprovalResponseItem():
            return item.denial_text()
        case McpListToolsItem():
            return ""


def without_oldest(history: list[Item], items: list[Item], n: int) -> tuple[list[Item], list[Item]]:
    """``history`` then ``items`` less their ``n`` oldest, and less the results of calls among those."""
    conversation = [*history, *items]
    gone = {item.call_id for item in conversation[:n] if isinstance(item, FunctionCallItem)}
    keep = [pos >= n and not (isinstance(item, FunctionCallOutputItem) and item.call_id in gone)
            for pos, item in enumerate(conversation)]
    split = len(history)
    return ([item for pos, item in enumerate(history) if keep[pos]],
            [item for pos, item in enumerate(items) if keep[split + pos]])


async def _count(pool: Tokenizer, model: str, text: str) -> int:
    return len(await pool.tokenize(model, text, add_special=False)) if text else 0


async def first_drop(pool: Tokenizer, model: str, *, history: list[Item], items: list[Item],
                     instructions: str | None, tools: list[FunctionTool], n_ctx: int,
                     max_output_tokens: int | None) -> int:
    """How many of the oldest items to drop so that the counted prompt fits."""
    conversation = [*history, *items]
    budget = n_ctx - min(max_output_tokens or 0, n_ctx // 2)
    fixed = FIXED_TOKENS + await _count(pool, model, instructions or "")
    if tools:
        fixed += await _count(pool, model, json.dumps(template_tools(tools)))
    sizes = [await _count(pool, model, _text(item)) + PER_ITEM_TOKENS for item in conversation]
    total = fixed + sum(sizes)
    dropped = 0
    # The newest item always stays: without it there is nothing to answer.
    while total > budget and dropped < len(conversation) - 1:
        total -= sizes[dropped]
        dropped += 1
    return dropped


def next_drop(dropped: int, retries: int, n_items: int) -> int | None:
    """After the worker refused the prompt as too long: how many to drop now
    (twice as many more each time), or None when only the newest item is left."""
    if dropped >= n_items - 1:
        return None
    return min(n_items - 1, dropped + (1 << retries))
