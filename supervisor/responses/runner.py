"""Run one response: plan the generation, stream it, build the events.

:func:`plan` turns a validated request, its stored history and the model's
facts into what the worker needs (chat messages, template tools, sampling
parameters, template variables) and how to parse the output.
:func:`run` drives the pool and yields :class:`~supervisor.responses.events.Event`s,
always ending with exactly one terminal event.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from formats.schema_gbnf import SchemaError
from formats.schema_keywords import Backend
from supervisor.errors import ApiError, BadRequest, ModelNotFound, Unavailable
from supervisor.generation.generic_calls import offer_in_prompt
from supervisor.generation.generic_parse import GenericParser
from supervisor.generation.harmony import HarmonyParser
from supervisor.generation.images import require_vision
from supervisor.generation.lark_calls import LARK_STYLES, lark_tool_grammar
from supervisor.generation.output_format import enforce_format
from supervisor.generation.parse import OutputParser
from supervisor.generation.pieces import Piece, StreamParser, ToolCall
from supervisor.generation.profile import TemplateProfile, served_profile
from supervisor.generation.tagged_grammar import forced_call_grammar
from supervisor.generation.template_vars import merged_vars
from supervisor.generation.sampling import asked_fields
from supervisor.generation.tool_schemas import checked_tools
from supervisor.generation.tools import FunctionTool, NamedFunction, Offer, PlanChoice
from supervisor.responses.convert import collect_images, template_tools, to_messages
from supervisor.responses.events import Event, EventBuilder
from supervisor.responses.items import Item
from supervisor.responses.logprobs import TextLogprobs
from supervisor.responses.models import (
    CreateRequest,
    FormatJsonObject,
    FormatJsonSchema,
)
from supervisor.responses.objects import Usage
from supervisor.workers.replies import Blame, Rejected
from worker.protocol import ChatMessage, Delta, Done, ModelFacts, SamplingParams

# The Responses API's include value that asks for output-text logprobs.
INCLUDE_LOGPROBS = "message.output_text.logprobs"


class Outputs(Protocol):
    """One admitted generation; ``aclose()`` cancels it, even unstarted."""

    def __aiter__(self) -> Outputs: ...

    async def accepted(self) -> None:
        """Wait until the worker takes it; a rejection raises ``ApiError``."""
        ...

    async def __anext__(self) -> Delta | Done: ...

    async def aclose(self) -> None: ...


class GenerationPool(Protocol):
    """The part of the worker pool the Responses API uses."""

    async def facts(self, model: str) -> ModelFacts: ...

    async def tokenize(self, model: str, text: str, add_special: bool = True) -> list[int]: ...

    async def admit(
        self,
        model: str,
        *,
        messages: list[ChatMessage] | None = None,
        prompt: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        params: SamplingParams | None = None,
        template_vars: dict[str, Any] | None = None,
        request_id: str = "",
        images: list[bytes] | None = None,
        lora_scale: float | None = None,
        caller: str = "",
        sampling_asked: Collection[str] = (),
    ) -> Outputs: ...


@dataclass
class Plan:
    messages: list[ChatMessage]
    params: SamplingParams
    tools: list[dict[str, Any]] | None = None
    template_vars: dict[str, Any] = field(default_factory=dict)
    profile: TemplateProfile = field(default_factory=TemplateProfile)
    tool_names: frozenset[str] = frozenset()
    # Each offered tool's JSON schema of arguments: the XML formats type values by it.
    tool_schemas: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    # A grammar forces JSON: a leading "{" is the answer, not a tool call.
    json_output: bool = False
    # Offered name -> (namespace, name) of each namespaced function.
    namespaces: dict[str, tuple[str, str]] = field(default_factory=dict)
    # The one function a forcing grammar allows, if only one.
    forced_name: str | None = None
    # The images the messages' ImageParts place, in order.
    images: list[bytes] = field(default_factory=list)
    # The adapter's scale for a <base>:<adapter> model; None = as trained.
    lora_scale: float | None = None
    # The generic format's grammar for "auto" admits an answer: no call is forced.
    may_answer: bool = False
    # The sampling fields the request set; the pool fills the others with the
    # model's defaults (supervisor/generation/sampling.py).
    sampling_asked: frozenset[str] = frozenset()

    @property
    def forced_call(self) -> bool:
        return self.params.grammar is not None and not self.json_output and not self.may_answer

    def named(self, pieces: list[Piece]) -> list[Piece]:
        """Calls of namespaced functions under their own name, with the namespace."""
        if not self.namespaces:
            return pieces
        return [p._replace(namespace=self.namespaces[p.name][0], name=self.namespaces[p.name][1])
                if isinstance(p, ToolCall) and p.name in self.namespaces else p for p in pieces]

    def parser(self) -> StreamParser:
        parser = self._parser()
        return ForcedCall(parser, self.forced_name) if self.forced_call and self.forced_name else parser

    def _parser(self) -> StreamParser:
        tool_names = frozenset() if self.json_output else self.tool_names
        if self.profile.generic_tools and tool_names:
            return GenericParser(tool_names, forced=self.forced_call, after_think=self.profile.starts_in_reasoning)
        if self.profile.harmony:
            # Channels mark reasoning and calls explicitly, grammar or not.
            return HarmonyParser(tool_names=tool_names, forced=self.forced_call)
        # A grammar leaves no room for a think block: JSON starts at once, and
        # a forced call only closes the block the template opened.
        forced = self.json_output or self.params.grammar is not None
        return OutputParser(
            thinking=self.profile.thinks and not forced,
            starts_in_reasoning=self.profile.starts_in_reasoning and not self.json_output,
            tool_names=tool_names,
            bare_json_calls=not self.json_output,
            forced=self.forced_call,
            style=self.profile.tool_style,
            schemas=self.tool_schemas,
        )


class ForcedCall:
    """A parser for output a grammar forces to call one known function: an
    output cut before even its name is that call, with no arguments yet."""

    def __init__(self, parser: StreamParser, name: str) -> None:
        self._parser = parser
        self._name = name
        self._called = False

    @property
    def in_reasoning(self) -> bool:
        return self._parser.in_reasoning

    def _seen(self, pieces: list[Piece]) -> list[Piece]:
        self._called = self._called or any(isinstance(p, ToolCall) for p in pieces)
        return pieces

    def feed(self, text: str) -> list[Piece]:
        return self._seen(self._parser.feed(text))

    def finish(self) -> list[Piece]:
        pieces = self._seen(self._parser.finish())
        return pieces if self._called else [*pieces, ToolCall(self._name, "", complete=False)]


def _forced_name(tools: list[FunctionTool], choice: PlanChoice) -> str | None:
    if isinstance(choice, NamedFunction):
        return choice.name
    return tools[0].name if choice == "required" and len(tools) == 1 else None


def _sampling(req: CreateRequest) -> SamplingParams:
    # The fields left out are filled when the pool admits it (Plan.sampling_asked).
    params = SamplingParams(max_tokens=req.max_output_tokens, ignore_eos=req.ignore_eos)
    if req.temperature is not None:
        params.temperature = req.temperature
    if req.top_p is not None:
        params.top_p = req.top_p
    fmt = req.text.format
    if isinstance(fmt, FormatJsonSchema):
        params.json_schema = json.dumps(fmt.schema)
    elif isinstance(fmt, FormatJsonObject):
        params.json_object = True
    if req.top_logprobs is not None or INCLUDE_LOGPROBS in (req.include or []):
        params.logprobs = req.top_logprobs or 0
    return params


def _constrain_calls(
    params: SamplingParams,
    tools: list[FunctionTool],
    choice: PlanChoice,
    parallel: bool,
    profile: TemplateProfile,
    guidance: bool = False,
    model: str = "",
) -> None:
    """Force a well-formed call for "required" or a named function, with a
    grammar that replaces any output format: LLGuidance's where ``guidance``
    (the model's vocab takes it) and the call format allows it
    (lark_calls.py), else our GBNF; else cap "auto" at one call."""
    if choice == "required" or isinstance(choice, NamedFunction):
        chosen = [t for t in tools if not isinstance(choice, NamedFunction) or t.name == choice.name]
        lark = guidance and profile.tool_style in LARK_STYLES
        checked = checked_tools(chosen, Backend.LLGUIDANCE if lark else Backend.GBNF, model)
        several = parallel and not isinstance(choice, NamedFunction)
        # The template opened a think block: the call follows its end, as the model writes it.
        prefix = "</think>\n\n" if profile.starts_in_reasoning else ""
        try:
            if lark:
                params.grammar = lark_tool_grammar(checked, style=profile.tool_style, parallel=several,
                                                   prefix=prefix)
            else:
                params.grammar = forced_call_grammar([(t.name, t.parameters) for t in chosen],
                                                     style=profile.tool_style, parallel=several, prefix=prefix)
        except SchemaError as exc:
            raise BadRequest(f"a tool's parameters cannot be enforced: {exc}", param="tools",
                             code="invalid_grammar") from exc
        params.json_schema, params.json_object = None, False
    elif tools and choice == "auto" and not parallel and profile.tool_style in ("hermes", "qwen3_coder"):
        # One call at most: stop at the end of the first; the parser closes it. (Not
        # GLM 4.5's: only its closing tag tells its last argument from one cut short.)
        params.stop = [*params.stop, "</tool_call>"]


def tool_plan(
    messages: list[ChatMessage],
    params: SamplingParams,
    profile: TemplateProfile,
    *,
    tools: list[FunctionTool],
    choice: PlanChoice,
    parallel: bool,
    template_vars: dict[str, Any] | None = None,
    namespaces: dict[str, tuple[str, str]] | None = None,
    guidance: bool = False,
    model: str = "",
) -> Plan:
    """The plan for ``messages`` offering ``tools`` under ``choice`` (chat
    completions share it); ``guidance``: the model's vocab takes LLGuidance
    grammars (``ModelFacts.schema_grammar``), named ``model`` in refusals."""
    use_tools = bool(tools) and choice != "none"
    if profile.tool_support != "native":
        # The template cannot list the tools: the prompt does (generic_calls.py).
        messages = offer_in_prompt(messages, params, profile, functions=tools if use_tools else [],
                                   choice=choice, parallel=parallel, guidance=guidance, model=model)
    if not profile.generic_tools:
        _constrain_calls(params, tools, choice, parallel, profile, guidance, model)
    return Plan(
        messages=messages,
        params=params,
        tools=template_tools(tools) if use_tools and not profile.generic_tools else None,
        template_vars=template_vars or {},
        profile=profile,
        tool_names=frozenset(t.name for t in tools) if use_tools else frozenset(),
        tool_schemas={t.name: t.parameters for t in tools} if use_tools else {},
        json_output=(params.json_schema is not None or params.json_object) and params.grammar is None,
        namespaces=(namespaces or {}) if use_tools else {},
        forced_name=_forced_name(tools, choice) if params.grammar is not None else None,
        may_answer=use_tools and profile.generic_tools and choice == "auto",
    )


def plan(req: CreateRequest, history: list[Item], items: list[Item], facts: ModelFacts,
         offer: Offer | None = None) -> Plan:
    profile = served_profile(facts)
    effort = req.reasoning.effort if req.reasoning else None
    offer = offer or Offer()
    images = collect_images(history, items)
    require_vision(req.model, images, facts)
    planned = tool_plan(
        to_messages(history, items, req.instructions),
        _sampling(req),
        profile,
        tools=offer.functions,
        choice=offer.choice,
        parallel=req.parallel_tool_calls,
        template_vars=merged_vars(profile.template_vars(effort), req.chat_template_kwargs, req.enable_thinking),
        namespaces=offer.namespaces,
        guidance=facts.schema_grammar == "llguidance",
        model=req.model,
    )
    fmt = req.text.format
    if isinstance(fmt, FormatJsonSchema):
        enforce_format(json.dumps(fmt.schema), planned.params, facts, generic_answer=planned.may_answer,
                       strict=bool(fmt.strict), param="text.format.schema", model=req.model)
    planned.images = images.data
    planned.lora_scale = req.lora_scale
    planned.sampling_asked = asked_fields(temperature=req.temperature, top_p=req.top_p)
    return planned


async def admit(pool: GenerationPool, model: str, plan: Plan, request_id: str = "", caller: str = "") -> Outputs:
    """Queue the generation on the model's worker for ``caller`` (who asked:
    supervisor/api/callers.py); a refusal raises here."""
    # Images only when there are some: a pool without image support still serves text.
    extra: dict[str, Any] = {"images": plan.images} if plan.images else {}
    if plan.lora_scale is not None:
        extra["lora_scale"] = plan.lora_scale
    if caller:
        extra["caller"] = caller
    return await pool.admit(
        model,
        messages=plan.messages,
        tools=plan.tools,
        params=plan.params,
        template_vars=plan.template_vars,
        request_id=request_id,
        sampling_asked=plan.sampling_asked,
        **extra,
    )


def in_responses_terms(exc: BadRequest, plan: Plan) -> BadRequest:
    """The one place a worker's rejection gets its Responses field."""
    if not isinstance(exc, Rejected):
        return exc
    if exc.cause is Blame.GRAMMAR:
        # A grammar comes from the output format, else from a forced tool call.
        return exc.blaming("text.format" if plan.json_output else "tool_choice")
    return exc.blaming("input")


async def run(
    pool: GenerationPool,
    model: str,
    plan: Plan,
    builder: EventBuilder,
    *,
    request_id: str = "",
    raise_early: bool = False,
    admitted: Outputs | None = None,
    halt: Callable[[], ApiError | None] | None = None,
    started: bool = False,
) -> AsyncGenerator[Event, None]:
    """Yield every event of the response, ending with one terminal event.

    With ``raise_early``, an unknown model, a refused request or a prompt the
    worker rejects (e.g. too long) raises before any output, so the caller can
    answer 404/503/400, instead of producing a failed response. ``admitted``
    is a generation the caller already queued (to refuse it as HTTP).
    ``halt``, asked after each output's events, stops the generation with
    the error it returns: the response fails with it. ``started``: the
    response's first events were sent already (a hosted tool loop's next generation).
    """
    for event in [] if started else builder.start():
        yield event
    parser = plan.parser()
    text_logprobs = TextLogprobs() if plan.params.logprobs is not None else None
    reasoning_tokens = 0
    done: Done | None = None
    produced = False
    try:
        outputs = admitted if admitted is not None else await admit(pool, model, plan, request_id)
        try:
            async for out in outputs:
                produced = True
                if isinstance(out, Done):
                    done = out
                    break
                if parser.in_reasoning:
                    reasoning_tokens += out.n_tokens
                pieces = plan.named(parser.feed(out.text))
                logprobs = text_logprobs.take(out.logprobs, pieces) if text_logprobs else None
                for event in builder.pieces(pieces, logprobs):
                    yield event
                if halt is not None and (stop := halt()) is not None:
                    raise stop
        finally:
            # Leaving early (client gone, cancelled) cancels the generation.
            await outputs.aclose()
    except ApiError as exc:
        if raise_early and not produced and isinstance(exc, (ModelNotFound, Unavailable, BadRequest)):
            if isinstance(exc, BadRequest):
                raise in_responses_terms(exc, plan) from exc
            raise
        for event in builder.failed(exc.code or "server_error", exc.message):
            yield event
        return
    for event in _ending(plan, parser, builder, text_logprobs, done, reasoning_tokens):
        yield event


def _ending(plan: Plan, parser: StreamParser, builder: EventBuilder, text_logprobs: TextLogprobs | None,
            done: Done | None, reasoning_tokens: int) -> Iterator[Event]:
    """The events after the last output: what the parser held, then the one terminal event."""
    pieces = plan.named(parser.finish())
    yield from builder.pieces(pieces, text_logprobs.take(None, pieces) if text_logprobs else None)
    if done is None:
        yield from builder.failed("server_error", "the model worker ended the stream without finishing")
        return
    usage = Usage.of(done.prompt_tokens, done.completion_tokens, done.cached_tokens, reasoning_tokens)
    if done.finish_reason == "cancelled":
        yield from builder.failed("cancelled", "the model worker cancelled the generation", usage)
        return
    yield from builder.completed(usage, truncated=done.finish_reason == "length", timed_out=done.timed_out)
