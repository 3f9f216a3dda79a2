"""A scripted worker pool for the Responses API tests.

It replays deltas, errors and delays for every generation and records what it
was asked, so event order, storage and failures can be tested exactly.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Collection
from dataclasses import dataclass, field
from typing import Any

from supervisor.errors import ModelNotFound
from worker.protocol import ChatMessage, Delta, Done, ModelFacts, SamplingParams

MODEL = "fake"

Step = Delta | Done | BaseException | float


@dataclass
class Call:
    messages: list[ChatMessage]
    tools: list[dict[str, Any]] | None
    params: SamplingParams
    template_vars: dict[str, Any]


@dataclass
class FakeOutputs:
    outputs: AsyncGenerator[Delta | Done, None]
    accept: BaseException | float | None
    closed: bool = False

    def __aiter__(self) -> FakeOutputs:
        return self

    async def __anext__(self) -> Delta | Done:
        return await anext(self.outputs)

    async def accepted(self) -> None:
        if isinstance(self.accept, BaseException):
            raise self.accept
        if self.accept is not None:
            await asyncio.sleep(self.accept)

    async def aclose(self) -> None:
        self.closed = True
        await self.outputs.aclose()


class NoModels:
    """A library that lists no model: the routes' checks before a load
    (such as an hf model's images) find nothing to refuse."""

    def entry(self, model_id: str) -> None:
        return None


@dataclass
class FakePool:
    """Replays ``script`` for every generate; a float step sleeps that long."""

    script: list[Step] = field(default_factory=list)
    # How the "worker" takes a request: at once (None), after a wait in the
    # queue (seconds) or by rejecting it (an exception).
    accept: BaseException | float | None = None
    template: str | None = None
    calls: list[Call] = field(default_factory=list)
    closed: int = 0
    admitted: list[FakeOutputs] = field(default_factory=list)
    models: NoModels = field(default_factory=NoModels)

    def say(self, *texts: str, finish: str = "stop", prompt_tokens: int = 7) -> None:
        self.script = [Delta(0, t, 1) for t in texts]
        self.script.append(Done(0, finish, prompt_tokens, len(texts), cached_tokens=2))  # type: ignore[arg-type]

    async def facts(self, model: str) -> ModelFacts:
        if model != MODEL:
            raise ModelNotFound(f"model {model!r} does not exist", param="model")
        return ModelFacts("x.gguf", 2048, 2048, 300, True, False, self.template)

    async def admit(self, model: str, **kwargs: Any) -> FakeOutputs:
        self.admitted.append(FakeOutputs(self.generate(model, **kwargs), self.accept))
        return self.admitted[-1]

    async def generate(
        self,
        model: str,
        *,
        messages: list[ChatMessage] | None = None,
        prompt: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        params: SamplingParams | None = None,
        template_vars: dict[str, Any] | None = None,
        request_id: str = "",
        caller: str = "",  # who asked (the real pool blames crashes on it)
        sampling_asked: Collection[str] = (),  # what the real pool leaves to the model's defaults
    ) -> AsyncGenerator[Delta | Done, None]:
        assert messages is not None and params is not None
        self.calls.append(Call(messages, tools, params, template_vars or {}))
        try:
            for step in self.script:
                if isinstance(step, float):
                    await asyncio.sleep(step)
                elif isinstance(step, BaseException):
                    raise step
                else:
                    yield step
        finally:
            self.closed += 1
