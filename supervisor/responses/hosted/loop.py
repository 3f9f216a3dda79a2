"""The hosted-tool loop: generate, run the calls, generate again.

One response, several generations. The first runs as any other (its
events, then the calls it made to hosted tools: ``mcp_call``,
``code_interpreter_call``, ``web_search_call`` and ``file_search_call``
items, in progress). Then each call runs
(``response.mcp_call.in_progress``, then ``completed`` or ``failed``;
``response.code_interpreter_call.interpreting``, then ``completed``;
``response.web_search_call.searching`` and ``response.file_search_call.searching``,
then ``completed``), its
result goes back to the model with the conversation so far, and the next
generation starts, until one ends without a hosted call. Limits end it cleanly: after ``max_iterations``
generations with calls, or once the calls took ``total_timeout_s``, the
model is told that the budget is spent and answers with no tools offered.
A cancelled response (the client left, a background cancel) cancels the
call running at that moment: the call is an await of this generator.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import msgspec

from supervisor.errors import ApiError
from supervisor.generation.tools import PlanChoice
from supervisor.responses.events import Event, EventBuilder
from supervisor.responses.hosted.session import HostedCall, HostedSession, parsed_arguments
from supervisor.responses.items import (
    CodeInterpreterCallItem,
    FileSearchCallItem,
    Item,
    McpCallItem,
    MessageItem,
    WebSearchCallItem,
    keep_read,
    normalize,
)
from supervisor.responses.objects import Usage
from supervisor.responses.runner import GenerationPool, Outputs, Plan, run

# Plan and queue the next generation of the response, given the output so far.
NextGeneration = Callable[[list[Item], PlanChoice], Awaitable[tuple[Plan, Outputs]]]

BUDGET_NOTE = ("The tool budget of this response is spent ({why}). Do not call tools any more: "
               "answer now from the tool results above.")


class ToolLoop:
    def __init__(self, session: HostedSession, clock: Callable[[], float] = time.monotonic) -> None:
        self.session = session
        self._clock = clock
        self._spent_s = 0.0
        # Calls run so far, by what they ask: a repeat gets the same result.
        self._results: dict[tuple[str, str, str], HostedCall] = {}

    async def events(self, pool: GenerationPool, model: str, builder: EventBuilder,
                     first: tuple[Plan, Outputs] | None, generate: NextGeneration, *, choice: PlanChoice = "auto",
                     request_id: str = "",
                     halt: Callable[[], ApiError | None] | None = None) -> AsyncGenerator[Event, None]:
        """Every event of the response, ending with one terminal event.
        ``first``: the first generation, queued already; None when the calls
        the user approved run first (it is planned with their results, under
        ``choice``)."""
        builder.hosted = self.session
        for event in builder.start():
            yield event
        for listing in self.session.listings():
            for event in self._listed(builder, listing):
                yield event
        for approved in self.session.approved:
            async for event in self._approved(builder, approved):
                yield event
        if first is None:
            try:
                first = await generate(list(builder.response.output), choice)
            except ApiError as exc:
                for event in builder.failed(exc.code or "server_error", exc.message):
                    yield event
                return
        plan, outputs = first
        iterations = 0
        while True:
            async for event in run(pool, model, plan, builder, request_id=request_id, admitted=outputs,
                                   halt=halt, started=True):
                yield event
            if builder.response.terminal:
                return
            for call in self.session.take_pending():
                async for event in self._run_call(builder, call):
                    yield event
            if self.session.asked:
                # Approval requests wait for the user: the response ends with this round.
                for event in builder.completed(Usage.of(0, 0, 0, 0), truncated=False):
                    yield event
                return
            iterations += 1
            why = self._budget_spent(iterations)
            extra: list[Item] = []
            if why is not None:
                extra.append(normalize(MessageItem(role="developer", content=BUDGET_NOTE.format(why=why))))
            try:
                plan, outputs = await generate([*builder.response.output, *extra],
                                               "none" if why is not None else "auto")
            except ApiError as exc:
                for event in builder.failed(exc.code or "server_error", exc.message):
                    yield event
                return

    def _budget_spent(self, iterations: int) -> str | None:
        settings = self.session.settings
        if iterations >= settings.max_iterations:
            return f"{settings.max_iterations} rounds of tool calls"
        if self._spent_s >= settings.total_timeout_s:
            return f"{settings.total_timeout_s:g} s of tool calls"
        return None

    @staticmethod
    def _listed(builder: EventBuilder, item: Any) -> list[Event]:
        index = builder.add_item(item)
        common = {"item_id": item.id, "output_index": index}
        state = "failed" if item.error else "completed"
        return [
            builder.event("response.output_item.added", output_index=index, item=item),
            builder.event("response.mcp_list_tools.in_progress", **common),
            builder.event(f"response.mcp_list_tools.{state}", **common),
            builder.event("response.output_item.done", output_index=index, item=item),
        ]

    async def _approved(self, builder: EventBuilder, call: McpCallItem) -> AsyncGenerator[Event, None]:
        """A call the user approved: its item, its arguments, then it runs."""
        index = builder.add_item(call)
        common = {"item_id": call.id, "output_index": index}
        yield builder.event("response.output_item.added", output_index=index, item=msgspec.structs.replace(call))
        yield builder.event("response.mcp_call_arguments.delta", delta=call.arguments, **common)
        yield builder.event("response.mcp_call_arguments.done", arguments=call.arguments, **common)
        async for event in self._run_call(builder, call):
            yield event

    async def _run_call(self, builder: EventBuilder, call: HostedCall) -> AsyncGenerator[Event, None]:
        index = builder.response.output.index(call)
        common = {"item_id": call.id, "output_index": index}
        if isinstance(call, CodeInterpreterCallItem):
            call.status = "interpreting"
            yield builder.event("response.code_interpreter_call.interpreting", **common)
        elif isinstance(call, WebSearchCallItem | FileSearchCallItem):
            call.status = "searching"
            yield builder.event(f"response.{_kind(call)}.searching", **common)
        else:
            yield builder.event("response.mcp_call.in_progress", **common)
        try:
            await self._result(call)
        except asyncio.CancelledError:
            # The response was cancelled (or its client left) while the call ran.
            call.status = "incomplete"
            raise
        if isinstance(call, CodeInterpreterCallItem | WebSearchCallItem | FileSearchCallItem):
            # The SDK has no event for a run that failed: the item's status says it.
            if call.status == "completed":
                yield builder.event(f"response.{_kind(call)}.completed", **common)
        else:
            call.status = "failed" if call.error is not None else "completed"
            yield builder.event(f"response.mcp_call.{call.status}", **common)
        yield builder.event("response.output_item.done", output_index=index, item=call)

    def _limit_s(self) -> float:
        settings = self.session.settings
        return min(settings.call_timeout_s, max(0.0, settings.total_timeout_s - self._spent_s))

    async def _result(self, call: HostedCall) -> None:
        """Run ``call`` (or take an earlier identical call's result) into its item."""
        key = _key(call)
        earlier = self._results.get(key) if self.session.settings.suppress_duplicates else None
        if earlier is not None:
            _copy_result(earlier, call)
            return
        started = self._clock()
        try:
            if isinstance(call, CodeInterpreterCallItem):
                assert self.session.code is not None
                await self.session.code.run(call, self._limit_s())
            elif isinstance(call, WebSearchCallItem):
                assert self.session.web is not None
                await self.session.web.run(call, self._limit_s())
            elif isinstance(call, FileSearchCallItem):
                assert self.session.files is not None
                await self.session.files.run(call, self._limit_s())
            else:
                await self._mcp_result(call)
        finally:
            self._spent_s += self._clock() - started
        self._results[key] = call

    async def _mcp_result(self, call: McpCallItem) -> None:
        arguments = parsed_arguments(call)
        if arguments is None:
            call.error = {"type": "mcp_protocol_error", "code": -32602,
                          "message": "the arguments are not a JSON object"}
            return
        server = self.session.servers[call.server_label].server
        limit = self._limit_s()
        try:
            result = await asyncio.wait_for(server.call(call.name, arguments), limit)
            call.output, call.error = result.output, result.error
        except TimeoutError:
            call.error = {"type": "http_error", "code": 504,
                          "message": f"the call took longer than {limit:g} s and was stopped"}


def _kind(call: HostedCall) -> str:
    """The item's type, as the SDK's events name it (``web_search_call``)."""
    return str(call.__struct_config__.tag)


def _key(call: HostedCall) -> tuple[str, str, str]:
    if isinstance(call, CodeInterpreterCallItem):
        return ("code_interpreter", call.container_id, call.code or "")
    if isinstance(call, WebSearchCallItem):
        return ("web_search", "", call.action.query or "")
    if isinstance(call, FileSearchCallItem):
        return ("file_search", "", "\n".join(call.queries))
    return (call.server_label, call.name, call.arguments)


def _copy_result(earlier: HostedCall, call: HostedCall) -> None:
    if isinstance(earlier, CodeInterpreterCallItem) and isinstance(call, CodeInterpreterCallItem):
        call.outputs, call.status = earlier.outputs, earlier.status
    elif isinstance(earlier, WebSearchCallItem) and isinstance(call, WebSearchCallItem):
        call.action.sources, call.results, call.status = earlier.action.sources, earlier.results, earlier.status
    elif isinstance(earlier, FileSearchCallItem) and isinstance(call, FileSearchCallItem):
        call.results, call.status = earlier.results, earlier.status
        keep_read(call, earlier.read() or [])
    elif isinstance(earlier, McpCallItem) and isinstance(call, McpCallItem):
        call.output, call.error = earlier.output, earlier.error
