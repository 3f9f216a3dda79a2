"""Forced tool calls on LLGuidance where the vocab allows it, GBNF where not.

On the byte-level BPE tiny model (tests/tiny_bpe.py), whose vocab LLGuidance
accepts, a forced call's grammar is LLGuidance's: the call syntax of the
template's family around ``%json`` arguments (supervisor/generation/lark_calls.py).
The model's weights are random, so its arguments are adversarial: every
call, over ten seeds (ten prompts on the Responses API, which takes no
seed), is validated strictly with jsonschema against a schema using the
keywords our GBNF does not enforce. On the SentencePiece-style demo model
LLGuidance is refused and the GBNF stays: a strict tool with such a keyword
is a 400 naming it, a tool without strict is served with a warning.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from formats.schema_lark import HEADER
from supervisor.generation.lark_calls import lark_tool_grammar
from tests.real_templates import by_name
from tests.server import Server, running, short_tempdir
from tests.tiny_bpe import write_tiny_bpe

SEEDS = range(10)
MAX_TOKENS = 300
# What our GBNF converter leaves unchecked (counts, lengths, patterns, bounds), with an enum
# beside; every number bounded to integers (a fraction's digits are unbounded: random weights
# write them until max_tokens).
ARGS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "color": {"enum": ["red", "green", "blue"]},
        "level": {"type": "integer", "minimum": 1, "maximum": 5},
        "slot": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 4},
    },
    "required": ["tags", "zip", "color", "level", "slot"],
    "additionalProperties": False,
}
LABEL: dict[str, Any] = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 5}},
                         "required": ["text"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "tag_place", "description": "Tag a place", "parameters": ARGS,
                                           "strict": True}},
         {"type": "function", "function": {"name": "label", "parameters": LABEL, "strict": True}}]
SCHEMAS = {"tag_place": ARGS, "label": LABEL}
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
# The BPE model under three call formats: llama.cpp's generic JSON (its
# own ChatML template lists no tools), Hermes (Qwen 2.5) and Llama 3's.
FORMATS = {"bpe": None, "bpe-hermes": "qwen2.5-instruct", "bpe-llama3": "llama3.1-instruct"}


@pytest.fixture(scope="module")
def srv(tiny_model_path: Path) -> Iterator[Server]:
    models = short_tempdir("gvt")
    for name, family in FORMATS.items():
        kwargs = {"chat_template": by_name(family).template} if family else {}
        # Room for the tools' prompt (their schemas) and a call.
        write_tiny_bpe(models / f"{name}.gguf", n_ctx=4096, **kwargs)
    (models / "spm.gguf").symlink_to(tiny_model_path)
    with running(Server(models, model="bpe", env={"GPUVISOR_N_CTX": "4096"})) as server:
        yield server


def validate(call: dict[str, Any], name: str) -> None:
    assert call["name"] == name or name == "*", call
    jsonschema.Draft202012Validator(SCHEMAS[call["name"]]).validate(json.loads(call["arguments"]))


def _chat(srv: Server, model: str, seed: int, choice: Any = "required",
          tools: list[dict[str, Any]] | None = None) -> httpx.Response:
    return httpx.post(srv.base_url + "/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": "tag the place"}], "tools": tools or TOOLS,
        "tool_choice": choice, "max_tokens": MAX_TOKENS, "seed": seed, "temperature": 1.0,
        # One call each: up to eight would not fit the tiny model's context beside the tools' prompt.
        "parallel_tool_calls": False})


def _strict_off(schema: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "tag_place", "parameters": schema}}]


def test_a_forced_call_grammar_is_lark_with_json_arguments() -> None:
    grammar = lark_tool_grammar([("tag_place", ARGS, False), ("now", None, False)], style="hermes", parallel=True)
    lines = grammar.splitlines()
    assert lines[0] == HEADER and lines[1].startswith("start: tagged")
    assert '"maxItems": 3' in grammar and "%json" in grammar and '"<tool_call>\\n"' in grammar


@pytest.mark.parametrize("model", list(FORMATS))
def test_forced_calls_hold_every_keyword_on_the_bpe_model(srv: Server, model: str) -> None:
    for seed in SEEDS:
        # Required (either tool) on even seeds, the named one on odd ones.
        named = seed % 2 == 1
        choice = {"type": "function", "function": {"name": "tag_place"}} if named else "required"
        r = _chat(srv, model, seed, choice)
        assert r.status_code == 200, r.text
        out = r.json()["choices"][0]
        assert out["finish_reason"] == "tool_calls", (seed, out)
        calls = out["message"]["tool_calls"]
        assert calls, (seed, out)
        for call in calls:
            validate(call["function"], "tag_place" if named else "*")


def test_forced_calls_hold_on_the_responses_api_too(srv: Server) -> None:
    for n in SEEDS:
        r = httpx.post(srv.base_url + "/v1/responses", timeout=60, json={
            "model": "bpe-hermes", "input": f"tag place {n}", "tools": RESPONSES_TOOLS,
            "tool_choice": {"type": "function", "name": "tag_place"} if n % 2 else "required",
            "max_output_tokens": MAX_TOKENS, "temperature": 0, "parallel_tool_calls": False})
        assert r.status_code == 200, r.text
        body = r.json()
        calls = [item for item in body["output"] if item["type"] == "function_call"]
        assert body["status"] == "completed" and calls, body
        for call in calls:
            validate(call, "tag_place" if n % 2 else "*")


def test_the_gbnf_fallback_refuses_a_strict_tool_keyword_it_does_not_enforce(srv: Server) -> None:
    r = _chat(srv, "spm", 0)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tools" and err["code"] == "unsupported_schema", err
    assert "tool 'tag_place'" in err["message"] and "maxItems at /properties/tags" in err["message"], err
    r = httpx.post(srv.base_url + "/v1/responses", timeout=60, json={
        "model": "spm", "input": "tag", "tools": RESPONSES_TOOLS, "tool_choice": "required"})
    assert r.status_code == 400 and "maxItems at /properties/tags" in r.json()["error"]["message"], r.text


def test_not_strict_the_fallback_serves_and_warns(srv: Server) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 3}}, "required": ["n"]}
    r = _chat(srv, "spm", 1, tools=_strict_off(schema))
    assert r.status_code == 200, r.text
    assert "tool tag_place: maximum at /properties/n not enforced in the arguments (gbnf" in srv.log_text()


def test_a_keyword_llguidance_lacks_is_refused_strict_and_ignored_otherwise(srv: Server) -> None:
    schema = {"type": "object", "properties": {"t": {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 2,
                                                     "uniqueItems": True}}, "required": ["t"],
              "additionalProperties": False}
    strict = [{"type": "function", "function": {"name": "tag_place", "parameters": schema, "strict": True}}]
    r = _chat(srv, "bpe-hermes", 0, tools=strict)
    assert r.status_code == 400 and "uniqueItems at /properties/t" in r.json()["error"]["message"], r.text
    for seed in range(3):
        r = _chat(srv, "bpe-hermes", seed, tools=_strict_off(schema))
        assert r.status_code == 200, r.text
        args = json.loads(r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])
        assert len(args["t"]) <= 2 and set(args["t"]) <= {1, 2}, args  # what LLGuidance implements still holds


def test_a_huge_count_in_a_tool_schema_is_refused_up_front(srv: Server) -> None:
    schema = {"type": "object", "properties": {"t": {"type": "array", "maxItems": 10**7}}}
    r = _chat(srv, "bpe", 0, tools=_strict_off(schema))
    assert r.status_code == 400 and "maxItems" in r.json()["error"]["message"], r.text
