"""Structured output on LLGuidance where the vocab allows it, GBNF where not.

The byte-level BPE tiny model (tests/tiny_bpe.py) stands in for a real
model: the worker's probe finds that LLGuidance accepts its vocab, and every
JSON-schema keyword below is enforced on it. Its weights are random, so its
answers are adversarial: each one, over ten seeds, is validated strictly
with jsonschema (formats included) and must end by itself ("stop"). The
SentencePiece-style demo model is refused by LLGuidance and falls back to
our GBNF, which enforces fewer keywords: a strict request with one of the
others is a 400 naming it, a non-strict one is served with a warning.
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from formats.schema_keywords import Backend, Unenforced, unenforced
from tests.server import Server, running, short_tempdir
from tests.worker_harness import spawn_worker
from worker import protocol as p

SEEDS = range(10)
# Enough for every answer below; an answer cut by it fails the test.
MAX_TOKENS = 400
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
SHORT = {"type": "string", "maxLength": 4}


def _closed(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False}


# Every keyword family, each bounded everywhere (random weights would
# otherwise write an unbounded string or number until max_tokens).
KEYWORDS: dict[str, dict[str, Any]] = {
    "minItems/maxItems": {"type": "array", "items": DIGIT, "minItems": 2, "maxItems": 3},
    "minLength/maxLength": _closed({"name": {"type": "string", "minLength": 3, "maxLength": 6}}),
    "pattern": _closed({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    "format date": {"type": "string", "format": "date"},
    "format date-time": {"type": "string", "format": "date-time"},
    "format time": {"type": "string", "format": "time"},
    "format uuid": {"type": "string", "format": "uuid"},
    "format email": {"type": "string", "format": "email", "maxLength": 24},
    "enum/const": _closed({"color": {"enum": ["red", "green", 3, None]}, "kind": {"const": "fixed"}}),
    "anyOf/oneOf": _closed({"a": {"anyOf": [DIGIT, SHORT]}, "b": {"oneOf": [{"type": "boolean"}, {"type": "null"}]}}),
    "allOf": {"allOf": [_closed({"a": DIGIT, "b": {"type": "boolean"}}, []), {"required": ["a"]},
                        {"required": ["b"]}]},
    "$defs/$ref recursive": {
        "$defs": {"node": _closed({"v": DIGIT, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}})},
        "$ref": "#/$defs/node"},
    "minimum/maximum/exclusive*/multipleOf": _closed({
        "i": {"type": "integer", "minimum": -5, "maximum": 5},
        "x": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 4},
        "m": {"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 50}}),
    "additionalProperties false": _closed({"a": {"type": "boolean"}, "b": DIGIT}, required=[]),
    "prefixItems": {"type": "array", "prefixItems": [DIGIT, SHORT, {"type": "boolean"}], "items": False,
                    "minItems": 3},
    "type arrays with null": _closed({"n": {"type": ["integer", "null"], "minimum": 0, "maximum": 9},
                                      "s": {"type": ["string", "null"], "maxLength": 3}}),
}

# RFC 3339, which JSON Schema's date-time and time name (jsonschema checks
# them only with an extra package installed).
_TIME = r"(\d{2}):(\d{2}):(\d{2})(\.\d+)?([Zz]|[+-](\d{2}):(\d{2}))"
FORMATS = jsonschema.FormatChecker()


def _is_time(value: object) -> bool:
    found = re.fullmatch(_TIME, value) if isinstance(value, str) else None
    if found is None:
        return False
    hour, minute, second = (int(found.group(i)) for i in (1, 2, 3))
    off = (int(found.group(6) or 0), int(found.group(7) or 0))
    return hour < 24 and minute < 60 and second <= 60 and off[0] < 24 and off[1] < 60


def _is_date_time(value: object) -> bool:
    if not isinstance(value, str) or len(value) < 11 or value[10] not in "Tt":
        return False
    try:
        datetime.date.fromisoformat(value[:10])
    except ValueError:
        return False
    return _is_time(value[11:])


FORMATS.checks("time")(_is_time)
FORMATS.checks("date-time")(_is_date_time)


def validate(answer: str, schema: dict[str, Any]) -> None:
    jsonschema.Draft202012Validator(schema, format_checker=FORMATS).validate(json.loads(answer))


@pytest.fixture(scope="module")
def both(tiny_bpe_path: Path, tiny_model_path: Path) -> Iterator[Server]:
    """A server with the BPE model ("bpe") and the SentencePiece one ("spm")."""
    models = short_tempdir("gvm")
    (models / "bpe.gguf").symlink_to(tiny_bpe_path)
    (models / "spm.gguf").symlink_to(tiny_model_path)
    with running(Server(models, model="bpe")) as srv:
        yield srv


def _chat(srv: Server, model: str, schema: dict[str, Any], seed: int, strict: bool = True) -> httpx.Response:
    return httpx.post(srv.base_url + "/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": "answer in JSON"}],
        "max_tokens": MAX_TOKENS, "seed": seed, "temperature": 1.0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": schema,
                                                                  "strict": strict}}})


def _models(srv: Server) -> dict[str, dict[str, Any]]:
    return {m["id"]: m for m in httpx.get(srv.base_url + "/api/models", timeout=10).json()["data"]}


async def test_the_bpe_model_loads_generates_and_llguidance_accepts_its_vocab(
        tiny_bpe_path: Path, tiny_model_path: Path) -> None:
    async with spawn_worker(tiny_bpe_path) as (w, hello):
        assert hello.facts.schema_grammar == "llguidance" and hello.facts.has_chat_template
        text, done = await w.generate(prompt="hello world")
        assert done.completion_tokens == 12 and text, (text, done)  # type: ignore[union-attr]
    async with spawn_worker(tiny_model_path) as (_, hello):
        assert hello.facts.schema_grammar == "gbnf"


@pytest.mark.parametrize("keyword", list(KEYWORDS))
def test_each_keyword_is_enforced_on_the_bpe_model(both: Server, keyword: str) -> None:
    schema = KEYWORDS[keyword]
    for seed in SEEDS:
        r = _chat(both, "bpe", schema, seed)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        answer = choice["message"]["content"]
        assert choice["finish_reason"] == "stop", (seed, answer)
        validate(answer, schema)


def test_the_responses_api_goes_through_llguidance_too(both: Server) -> None:
    schema = KEYWORDS["minItems/maxItems"]
    # The Responses API takes no seed: greedy answers to ten prompts instead.
    for n in SEEDS:
        r = httpx.post(both.base_url + "/v1/responses", timeout=60, json={
            "model": "bpe", "input": f"numbers {n}", "max_output_tokens": MAX_TOKENS, "temperature": 0,
            "text": {"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}}})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["status"] == "completed", body
        validate(body["output"][0]["content"][0]["text"], schema)


def test_the_model_view_says_which_grammar_enforces_schemas(both: Server) -> None:
    _chat(both, "spm", {"type": "boolean"}, 0)
    models = _models(both)
    assert models["bpe"]["structured_output"] == "llguidance"
    assert models["spm"]["structured_output"] == "gbnf"


def test_the_gbnf_fallback_refuses_a_strict_keyword_it_does_not_enforce(both: Server) -> None:
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                        "maxItems": 3}}, "required": ["tags"]}
    r = _chat(both, "spm", schema, 0)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format.json_schema.schema" and err["code"] == "unsupported_schema"
    assert "maxItems at /properties/tags" in err["message"]
    r = httpx.post(both.base_url + "/v1/responses", timeout=60, json={
        "model": "spm", "input": "tags",
        "text": {"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format.schema", r.text
    # The same keywords hold on the BPE model, through LLGuidance.
    assert _chat(both, "bpe", {**schema, "additionalProperties": False}, 0).status_code == 200


def test_not_strict_the_fallback_serves_and_warns(both: Server) -> None:
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 2}
    r = _chat(both, "spm", schema, 1, strict=False)
    assert r.status_code == 200, r.text
    assert "maxItems at /, minimum at /items, maximum at /items are not enforced (gbnf" in both.log_text()


def test_a_keyword_llguidance_lacks_is_refused_strict_and_ignored_otherwise(both: Server) -> None:
    schema = {"type": "array", "items": DIGIT, "maxItems": 3, "uniqueItems": True}
    r = _chat(both, "bpe", schema, 0)
    assert r.status_code == 400 and "uniqueItems at /" in r.json()["error"]["message"], r.text
    r = _chat(both, "bpe", schema, 0, strict=False)
    assert r.status_code == 200, r.text
    answer = json.loads(r.json()["choices"][0]["message"]["content"])
    assert len(answer) <= 3 and all(0 <= x <= 9 for x in answer)  # what LLGuidance implements still holds


def test_a_schema_the_engine_cannot_compile_is_a_400_not_unconstrained_text(both: Server) -> None:
    # Not a keyword the parent knows of: the worker's compile check catches it.
    for strict in (True, False):
        r = _chat(both, "bpe", {"type": "strin"}, 0, strict=strict)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_grammar" and err["param"] == "response_format", err
    # The worker goes on serving schemas it can compile.
    assert _chat(both, "bpe", {"type": "boolean"}, 0).json()["choices"][0]["message"]["content"] in ("true", "false")


async def test_the_compile_check_changes_no_answer(tiny_bpe_path: Path) -> None:
    # The first request with a schema is checked first (on its own prompt),
    # the next is not: both give the same seeded answer, and the check's
    # prefill is reused from the slot's cache.
    params = p.SamplingParams(max_tokens=40, seed=7, json_schema=json.dumps(KEYWORDS["pattern"]))
    async with spawn_worker(tiny_bpe_path) as (w, _):
        first, done = await w.generate(prompt="a longer prompt for the cache", params=params)
        again, done_again = await w.generate(prompt="a longer prompt for the cache", params=params)
    assert first == again and isinstance(done, p.Done) and isinstance(done_again, p.Done)
    assert done.cached_tokens > 0, done
    validate(first, KEYWORDS["pattern"])


def test_which_keywords_each_grammar_leaves_unenforced() -> None:
    schema = {
        "type": "object", "title": "annotations and unknown keywords constrain nothing", "x-extra": 1,
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "uniqueItems": True},
            "when": {"type": "string", "format": "date"},
            "site": {"type": "string", "format": "uri"},
            "a/b": {"not": {"type": "null"}},
        },
        "required": ["tags", "missing"],
        "$defs": {"n": {"type": "integer", "minimum": 0}},
    }
    assert [str(u) for u in unenforced(schema, Backend.GBNF)] == [
        "required at /", "uniqueItems at /properties/tags", "maxLength at /properties/tags/items",
        "format at /properties/when", "format at /properties/site", "not at /properties/a~1b",
        "minimum at /$defs/n"]
    assert [str(u) for u in unenforced(schema, Backend.LLGUIDANCE)] == [
        "uniqueItems at /properties/tags", "format at /properties/site", "not at /properties/a~1b"]
    assert unenforced(KEYWORDS["$defs/$ref recursive"], Backend.GBNF) == [
        Unenforced("/$defs/node/properties/v", "minimum"), Unenforced("/$defs/node/properties/v", "maximum")]


def test_a_count_past_the_bound_never_reaches_the_engine(both: Server) -> None:
    # LLGuidance writes item counts out: 10**7 took the engine's loop 84 s to refuse.
    r = _chat(both, "bpe", {"type": "array", "items": DIGIT, "maxItems": 10**7}, 0)
    assert r.status_code == 400, r.text
    assert "schema.maxItems = 10000000 is over the limit" in r.json()["error"]["message"]
