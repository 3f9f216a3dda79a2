"""Tools for a model whose chat template has none: llama.cpp's generic format.

This goes beyond the engine: its chat path would do the same (llama-server's
"generic" format, common/chat.cpp), but we render prompts ourselves and need
it on the completions path. What llama-server does for such a template, and
what is done here:

- the tools are described in the system prompt (merged into the request's
  own system message, or a new one), with the instruction to answer in JSON;
- a grammar holds the whole output to one JSON object: a call
  ``{"tool_call": {"name": ..., "arguments": {...}}}`` (several at once:
  ``{"tool_calls": [...]}``) or, unless a call is required, an answer
  ``{"response": "..."}``. Names are the offered ones only and arguments
  follow each tool's parameters schema; with a JSON output format the
  answer is that JSON instead of a string;
- :class:`~supervisor.generation.generic_parse.GenericParser` reads the
  object back into calls or text, streaming the answer as it is written.

A template that opens a think block in its generation prompt has it closed
by the grammar first, as for a forced call: no reasoning under this grammar.

The history is made renderable too: the template cannot show an earlier
assistant call nor a tool result, so a call becomes its JSON in the
assistant's text and a result a user message ``{"tool_response": ...}``.

A template that has its own call markup but lists no tools (DeepSeek-R1)
keeps its format; only the tool list is added to its system prompt.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from formats.schema_gbnf import SchemaError, SchemaGrammar, gbnf_literal
from formats.schema_keywords import Backend, unenforced
from formats.schema_lark import NotASchema, lark_json
from supervisor.errors import BadRequest
from supervisor.generation.grammar import MAX_PARALLEL_CALLS, args_rule, call_body
from supervisor.generation.lark_calls import lark_generic_grammar
from supervisor.generation.profile import TemplateProfile
from supervisor.generation.tool_schemas import checked_tools
from supervisor.generation.tools import FunctionTool, NamedFunction, PlanChoice
from worker.protocol import ChatMessage, ContentPart, ImagePart, SamplingParams, TextPart

# The generic format's keys, as llama.cpp's generic format writes them.
CALL_KEY = "tool_call"
CALLS_KEY = "tool_calls"
ANSWER_KEY = "response"
RESULT_KEY = "tool_response"


# ------------------------------------------------------------------ prompt


def _tool_list(functions: list[FunctionTool]) -> str:
    described = []
    for fn in functions:
        entry: dict[str, Any] = {"name": fn.name}
        if fn.description:
            entry["description"] = fn.description
        entry["parameters"] = fn.parameters or {"type": "object", "properties": {}}
        described.append(entry)
    # One line per tool: a small context has room for more of them.
    return "\n".join(json.dumps(entry, ensure_ascii=False) for entry in described)


def tools_prompt(functions: list[FunctionTool], choice: PlanChoice, *, parallel: bool, generic: bool) -> str:
    """The system prompt text that offers ``functions``; with ``generic`` it
    also says how to answer (the grammar holds the model to it either way)."""
    text = f"You can call these tools; their parameters are JSON schemas.\n{_tool_list(functions)}"
    if not generic:
        return text
    call = '{"%s": {"name": %s, "arguments": {...}}}'
    if isinstance(choice, NamedFunction):
        only = call % (CALL_KEY, json.dumps(choice.name))
        return f"{text}\n\nCall {choice.name}. Reply with one JSON object only: {only}"
    ways = [f"{call % (CALL_KEY, '...')} to call a tool"]
    if parallel:
        ways.append(f'{{"{CALLS_KEY}": [{{"name": ..., "arguments": {{...}}}}, ...]}} to call several')
    if choice != "required":
        ways.append(f'{{"{ANSWER_KEY}": "..."}} to answer the user')
    must = "You must call a tool. " if choice == "required" else ""
    return f"{text}\n\n{must}Reply with one JSON object only: " + "; ".join(ways) + "."


def with_system(messages: list[ChatMessage], text: str, *, system_role: bool) -> list[ChatMessage]:
    """``messages`` with ``text`` at the end of the system message (a new one
    first if none), or, for a template that takes no system role, at the
    start of the first user message."""
    if system_role:
        if messages and messages[0].role == "system":
            return [_joined(text, messages[0], after=True), *messages[1:]]
        return [ChatMessage("system", text), *messages]
    for i, msg in enumerate(messages):
        if msg.role == "user":
            return [*messages[:i], _joined(text, msg, after=False), *messages[i + 1 :]]
    return [ChatMessage("user", text), *messages]


def _joined(text: str, msg: ChatMessage, *, after: bool) -> ChatMessage:
    """``msg`` with ``text`` after (or before) its own content."""
    if msg.parts is not None:
        parts: list[ContentPart] = ([*msg.parts, TextPart("\n\n" + text)] if after
                                    else [TextPart(text + "\n\n"), *msg.parts])
        return msgspec.structs.replace(msg, parts=parts)
    own = msg.content or ""
    content = (f"{own}\n\n{text}" if after else f"{text}\n\n{own}") if own else text
    return msgspec.structs.replace(msg, content=content)


# ----------------------------------------------------------------- history


def _arguments(call: dict[str, Any]) -> tuple[str, Any]:
    function = call.get("function") or {}
    raw = function.get("arguments", "{}")
    try:
        args = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        args = raw  # not JSON: the model sees the client's text
    return str(function.get("name", "")), args


def calls_text(calls: list[dict[str, Any]]) -> str:
    """An assistant turn's calls written in the generic format."""
    written = [{"name": name, "arguments": args} for name, args in map(_arguments, calls)]
    if len(written) == 1:
        return json.dumps({CALL_KEY: written[0]}, ensure_ascii=False)
    return json.dumps({CALLS_KEY: written}, ensure_ascii=False)


def _result(msg: ChatMessage) -> ChatMessage:
    """A tool result as a user message any template renders."""
    head: dict[str, Any] = {"name": msg.name} if msg.name else {}
    if msg.parts is not None and any(isinstance(p, ImagePart) for p in msg.parts):
        # Media cannot sit inside JSON: the result's parts follow its header.
        return ChatMessage("user", parts=[TextPart(json.dumps({RESULT_KEY: head}, ensure_ascii=False) + "\n"),
                                          *msg.parts])
    text = msg.content if msg.parts is None else "".join(p.text for p in msg.parts if isinstance(p, TextPart))
    return ChatMessage("user", json.dumps({RESULT_KEY: {**head, "content": text or ""}}, ensure_ascii=False))


def _merge(first: ChatMessage, second: ChatMessage) -> ChatMessage:
    if first.parts is None and second.parts is None:
        return ChatMessage("user", f"{first.content}\n{second.content}")
    parts = [*(first.parts or [TextPart(first.content or "")]), TextPart("\n"),
             *(second.parts or [TextPart(second.content or "")])]
    return ChatMessage("user", parts=parts)


def portable_history(messages: list[ChatMessage]) -> list[ChatMessage]:
    """``messages`` with earlier calls and results as text (see the module doc)."""
    out: list[ChatMessage] = []
    for i, msg in enumerate(messages):
        if msg.role == "tool":
            result = _result(msg)
            if i and messages[i - 1].role == "tool":
                # Results in a row are one turn: templates may require turns to alternate.
                out[-1] = _merge(out[-1], result)
            else:
                out.append(result)
        elif msg.role == "assistant" and msg.tool_calls:
            written = calls_text(msg.tool_calls)
            own = msg.content or ""
            out.append(ChatMessage("assistant", f"{own}\n{written}" if own.strip() else written,
                                   reasoning_content=msg.reasoning_content))
        else:
            out.append(msg)
    return out


# ----------------------------------------------------------------- grammar


def _answer_rule(g: SchemaGrammar, params: SamplingParams) -> str:
    """The answer's value: a string, or the request's JSON output format."""
    if params.json_schema is not None:
        schema = json.loads(params.json_schema)
        g.strict = True  # an output format the client asked for is never loosened
        try:
            return g.schema_rule(schema, "answer-value", root=schema if isinstance(schema, dict) else None)
        finally:
            g.strict = False
    return "object" if params.json_object else "string"


def generic_grammar(functions: list[FunctionTool], choice: PlanChoice, *, parallel: bool, params: SamplingParams,
                    prefix: str = "") -> str:
    """GBNF for the whole output: one call (or several, with ``parallel``)
    to the functions ``choice`` allows, or an answer unless a call is required.
    ``prefix`` comes first (the end of a think block the template opened)."""
    named = choice.name if isinstance(choice, NamedFunction) else None
    chosen = [fn for fn in functions if named is None or fn.name == named]
    if not chosen:
        raise ValueError("generic_grammar needs at least one function")
    g = SchemaGrammar()
    bodies = [g.add(f"call-{fn.name}", call_body(fn.name, args_rule(g, fn.name, fn.parameters), "hermes"))
              for fn in chosen]
    call = g.add("call", " | ".join(bodies))
    ways = [g.add("one-call", f'{gbnf_literal("{" + json.dumps(CALL_KEY) + ": ")} {call} "}}"')]
    if parallel and named is None:
        head = gbnf_literal("{" + json.dumps(CALLS_KEY) + ": [")
        ways.append(g.add("some-calls", f'{head} {call} ( ", " {call} ){{0,{MAX_PARALLEL_CALLS - 1}}} "]}}"'))
    if choice == "auto":
        answer = _answer_rule(g, params)
        ways.append(g.add("answer", f'{gbnf_literal("{" + json.dumps(ANSWER_KEY) + ": ")} {answer} "}}"'))
    root = " | ".join(ways)
    return g.render(f"{gbnf_literal(prefix)} ( {root} )" if prefix else root)


def _lark_answer(params: SamplingParams) -> str:
    """The answer's ``%json`` rule: a string, or the request's JSON output
    format. LLGuidance ignores a keyword it does not implement (else it
    refuses the whole grammar); output_format.py refuses that when strict."""
    if params.json_schema is not None:
        schema = json.loads(params.json_schema)
        return lark_json(schema, lenient=bool(unenforced(schema, Backend.LLGUIDANCE)))
    return lark_json({"type": "object"} if params.json_object else {"type": "string"})


def generic_lark(functions: list[FunctionTool], choice: PlanChoice, *, parallel: bool, params: SamplingParams,
                 prefix: str = "", model: str = "") -> str:
    """:func:`generic_grammar` as an LLGuidance grammar (lark_calls.py), for
    a vocab that takes it: the arguments hold every keyword it implements."""
    named = choice.name if isinstance(choice, NamedFunction) else None
    chosen = [fn for fn in functions if named is None or fn.name == named]
    if not chosen:
        raise ValueError("generic_lark needs at least one function")
    return lark_generic_grammar(checked_tools(chosen, Backend.LLGUIDANCE, model),
                                keys=(CALL_KEY, CALLS_KEY, ANSWER_KEY), several=parallel and named is None,
                                answer=_lark_answer(params) if choice == "auto" else None, prefix=prefix)


# ------------------------------------------------------------------- offer


def offer_in_prompt(messages: list[ChatMessage], params: SamplingParams, profile: TemplateProfile, *,
                    functions: list[FunctionTool], choice: PlanChoice, parallel: bool, guidance: bool = False,
                    model: str = "") -> list[ChatMessage]:
    """The messages that offer ``functions`` to a template that cannot list
    them; for the generic format ``params`` get its grammar (LLGuidance's
    where ``guidance``: the model's vocab takes it). ``functions`` is empty
    when none are offered (``tool_choice: none``): only the history is
    rewritten then."""
    if not profile.generic_tools:
        if not functions:
            return messages
        return with_system(messages, tools_prompt(functions, choice, parallel=parallel, generic=False),
                           system_role=profile.system_role)
    messages = portable_history(messages)
    if not functions:
        return messages
    prefix = "</think>\n\n" if profile.starts_in_reasoning else ""
    try:
        if guidance:
            params.grammar = generic_lark(functions, choice, parallel=parallel, params=params, prefix=prefix,
                                          model=model)
        else:
            checked_tools(functions if not isinstance(choice, NamedFunction)
                          else [fn for fn in functions if fn.name == choice.name], Backend.GBNF, model)
            params.grammar = generic_grammar(functions, choice, parallel=parallel, params=params, prefix=prefix)
    except (SchemaError, NotASchema) as exc:
        raise BadRequest(f"a tool's parameters or the output format cannot be enforced: {exc}", param="tools",
                         code="invalid_grammar") from exc
    # The grammar holds the output format too (an answer in that format).
    params.json_schema, params.json_object = None, False
    return with_system(messages, tools_prompt(functions, choice, parallel=parallel, generic=True),
                       system_role=profile.system_role)
