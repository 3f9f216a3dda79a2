"""A Hugging Face model served by a vLLM worker through the real server: its
fit's KV budget, streamed deltas, cancel, parallel requests, speculative
decoding (vLLM's prompt lookup, a draft model, an EAGLE and an EAGLE-3
head keep the greedy text).

One worker for the whole module: vLLM's start takes half a minute on the
CPU. Needs the vLLM environment (``make install-vllm``) and the train extra
(the tiny model is made with transformers)."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import psutil
import pytest

from supervisor.config import default_vllm_python
from tests.server import Server, running, short_tempdir

pytest.importorskip("transformers", reason="needs the train extra")
VLLM_PYTHON = default_vllm_python()
if not VLLM_PYTHON:
    pytest.skip("no vLLM environment (make install-vllm)", allow_module_level=True)

from tests.lora_support import random_adapter
from tests.tiny_eagle import build_eagle3_head, build_eagle_head
from tests.tiny_hf import build_vllm_model, put_in_hub_cache
from tests.tiny_vision import png
from tests.vllm_drafting import assert_budget

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny-vllm"
# A PEFT adapter dir beside its base: served as MODEL:ADAPTER by the same worker.
ADAPTER = "tiny-lora"
# The same model as a Hub cache snapshot (listed by its repo id), set to
# draft with vLLM's prompt lookup (n-grams) in the config file.
HUB_MODEL = "lab/tiny-vllm-hub"
DRAFT_MAX = 4
# The model's weights with two tokens' ids swapped in its tokenizer: no draft for it.
OTHER_VOCAB = "tiny-vllm-swapped"
# An EAGLE draft head for MODEL's weights (tests/tiny_eagle.py): drafts for HUB_MODEL.
HEAD = "tiny-vllm-eagle"
# An EAGLE-3 head for the same weights.
HEAD3 = "tiny-vllm-eagle3"
# Long enough that a stream cancelled after its first chunk cannot have ended by itself.
N_CTX = 16384


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    models = short_tempdir("gvv")
    build_vllm_model(models / MODEL, max_position_embeddings=N_CTX)
    # Rank 20: vLLM's max_lora_rank takes a few values only (16, 32, ...); the worker must pick 32.
    random_adapter(models / MODEL, models / ADAPTER, seed=1, r=20, alpha=40)
    # Where a fine-tune job writes its adapter: served as MODEL:run1 with no export.
    outputs = short_tempdir("gvo")
    random_adapter(models / MODEL, outputs / "run1" / "adapter", seed=2, r=8, alpha=16)
    hub = models.parent / f"{models.name}-hub"
    put_in_hub_cache(models / MODEL, hub, HUB_MODEL)
    _swapped_vocab(models / MODEL, models / OTHER_VOCAB)
    build_eagle_head(models / MODEL, models / HEAD)
    build_eagle3_head(models / MODEL, models / HEAD3)
    env = {"GPUVISOR_VLLM_PYTHON": VLLM_PYTHON, "GPUVISOR_PARALLEL": "2", "GPUVISOR_N_CTX": str(N_CTX),
           "HF_HUB_CACHE": str(hub), "GPUVISOR_OUTPUTS_DIR": str(outputs)}
    config = models.parent / f"{models.name}.toml"
    config.write_text(f'[model_defaults."{HUB_MODEL}"]\nspeculative = "ngram"\ndraft_max = {DRAFT_MAX}\n')
    with running(Server(models, env=env, model=MODEL, args=["--config", str(config)])) as server:
        r = httpx.post(f"{server.base_url}/api/models/{MODEL}/load", timeout=300)
        assert r.status_code == 200, r.text
        server.wait_worker(lambda w: w["state"] == "ready", timeout=240)
        yield server


def _swapped_vocab(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst)
    tok = json.loads((dst / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.__getitem__)[-2:]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (dst / "tokenizer.json").write_text(json.dumps(tok))


def _body(max_tokens: int, content: str = "What colour is the sky?") -> dict[str, Any]:
    return {"model": MODEL, "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "messages": [{"role": "user", "content": content}]}


def _chunks(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]


def test_listed_with_its_engine_and_fit(srv: Server) -> None:
    models = {m["id"]: m for m in httpx.get(srv.base_url + "/v1/models", timeout=10).json()["data"]}
    assert (models[MODEL]["engine"], models[MODEL]["state"]) == ("vllm", "ready")
    item = httpx.get(f"{srv.base_url}/api/models/{MODEL}", timeout=10).json()
    fit = item["fit"]
    # 2 layers x 2 KV heads x 64 x (K, V) x 2 bytes = 1 KiB per token, for
    # n_ctx tokens x 2 sequences, and the one page of 128 tokens (the CPU
    # build's) that vLLM's block pool holds back.
    assert (fit["n_ctx"], fit["kv_bytes"]) == (N_CTX, (N_CTX * 2 + 128) * 1024)
    # vLLM's own figure for the budget the worker gave it: as many tokens.
    log = httpx.get(f"{srv.base_url}/api/models/{MODEL}/log", timeout=10).text
    found = re.search(r"KV cache size: ([\d,]+) tokens", log)
    assert found is not None, log[-2000:]
    assert int(found.group(1).replace(",", "")) == fit["kv_bytes"] // 1024


def test_chat_streams_deltas(srv: Server) -> None:
    with httpx.stream("POST", srv.base_url + "/v1/chat/completions", json=_body(48), timeout=120) as r:
        assert r.status_code == 200
        chunks = _chunks(list(r.iter_lines()))
    deltas = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    assert sum(1 for d in deltas if d) >= 2, chunks
    assert chunks[-1]["choices"] == [] or chunks[-1]["choices"][0]["finish_reason"] == "length"
    done = httpx.post(srv.base_url + "/v1/chat/completions", json={**_body(48), "stream": False}, timeout=120)
    body = done.json()
    assert body["usage"]["completion_tokens"] == 48 and body["choices"][0]["finish_reason"] == "length"
    # Greedy: the same text streamed and not.
    assert body["choices"][0]["message"]["content"] == "".join(d for d in deltas if d)


def test_closing_a_stream_cancels_it(srv: Server) -> None:
    before = srv.worker(MODEL)["stats"] or {}
    asked = N_CTX - 100
    with httpx.stream("POST", srv.base_url + "/v1/chat/completions", json=_body(asked), timeout=120) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass
    w = srv.wait_worker(lambda w: bool(w["stats"]) and w["stats"]["requests_cancelled"]
                        > before.get("requests_cancelled", 0) and not w["stats"]["busy"], MODEL, timeout=60)
    # Cut short, not run to the end: how soon depends on when the parent's
    # next write meets the closed socket, which on a busy machine was seen to
    # take tens of seconds (most of the asked tokens), so the bound is the end.
    assert w["stats"]["tokens_generated"] - before.get("tokens_generated", 0) < asked


def test_a_short_request_runs_beside_a_long_stream(srv: Server) -> None:
    url = srv.base_url + "/v1/chat/completions"

    async def run() -> tuple[int, bool]:
        async with httpx.AsyncClient(timeout=120) as c:
            first, ended = asyncio.Event(), asyncio.Event()

            async def long() -> None:
                async with c.stream("POST", url, json=_body(N_CTX - 64, "Tell me about fish")) as resp:
                    async for line in resp.aiter_lines():
                        chunks = _chunks([line])
                        # Its first token, not a keepalive comment sent before the engine took it.
                        if any(ch["choices"] and ch["choices"][0]["delta"].get("content") for ch in chunks):
                            first.set()
                        if any(ch["choices"] and ch["choices"][0]["finish_reason"] for ch in chunks):
                            ended.set()

            reader = asyncio.create_task(long())
            await asyncio.wait_for(first.wait(), 60)
            short = await c.post(url, json={**_body(8, "hi"), "stream": False})
            # A worker running one request at a time would answer only after
            # the long stream's thousands of tokens: the long one runs on.
            long_ended = ended.is_set()
            reader.cancel()  # closing the long stream cancels it
            return short.json()["usage"]["completion_tokens"], long_ended

    assert asyncio.run(run()) == (8, False)


def test_logprobs(srv: Server) -> None:
    body = {**_body(4), "stream": False, "logprobs": True, "top_logprobs": 2}
    r = httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for token in content:
        assert token["logprob"] <= 0 and len(token["top_logprobs"]) == 2
        assert token["top_logprobs"][0]["logprob"] >= token["top_logprobs"][1]["logprob"]


def _text(srv: Server, max_tokens: int, **fields: Any) -> str:
    r = httpx.post(srv.base_url + "/v1/chat/completions", json={**_body(max_tokens), "stream": False, **fields},
                   timeout=120)
    assert r.status_code == 200, (fields, r.text)
    return str(r.json()["choices"][0]["message"]["content"])


def _took_the_top(srv: Server, **fields: Any) -> list[bool]:
    """Per generated token: was it (one of) the model's most likely? From
    the logprobs of the raw logits, so ties in the bf16 logits count as top."""
    r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=120, json={
        **_body(64), "stream": False, "logprobs": True, "top_logprobs": 1, **fields})
    assert r.status_code == 200, (fields, r.text)
    return [abs(t["logprob"] - t["top_logprobs"][0]["logprob"]) < 1e-6
            for t in r.json()["choices"][0]["logprobs"]["content"]]


def test_each_sampling_field_reaches_vllm(srv: Server) -> None:
    greedy = _text(srv, 64, temperature=0)
    wide = {"temperature": 1.5, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    assert not all(_took_the_top(srv, seed=3, **wide))  # hot sampling leaves the top token at times
    # Each of these leaves only the most likely token, however hot the temperature.
    for only_top in ({"top_k": 1}, {"top_p": 0.0}, {"min_p": 1.0}):
        assert all(_took_the_top(srv, seed=3, **{**wide, **only_top})), only_top
    sampled = _text(srv, 64, seed=1, **wide)
    assert sampled != greedy and _text(srv, 64, seed=1, **wide) == sampled
    assert _text(srv, 64, seed=2, **wide) != sampled
    # The random model repeats itself within 64 tokens: a penalty changes its greedy choice.
    for penalty in ({"repeat_penalty": 2.0}, {"presence_penalty": 2.0}, {"frequency_penalty": 2.0}):
        assert _text(srv, 64, temperature=0, **penalty) != greedy, penalty
    # A stop string ends the text where it begins (not included), finish_reason "stop".
    at = next(i for i in range(8, len(greedy) - 4) if greedy.find(greedy[i:i + 3]) == i)
    r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=120, json={
        **_body(64), "stream": False, "temperature": 0, "stop": [greedy[at:at + 3]]})
    choice = r.json()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == (greedy[:at], "stop"), choice
    # A value vLLM does not take (it needs repetition_penalty > 0) is the caller's error, not the engine's.
    r = httpx.post(srv.base_url + "/v1/chat/completions", json={**_body(4), "stream": False, "repeat_penalty": 0.0},
                   timeout=120)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", r.text


def test_a_repeated_prefix_is_served_from_vllms_prefix_cache(srv: Server) -> None:
    # Longer than a few of the CPU build's 128-token KV pages.
    body = {**_body(1, "the cat sat on the mat " * 100), "stream": False}
    first = httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=120).json()["usage"]
    again = httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=120).json()["usage"]
    assert first["prompt_tokens"] == again["prompt_tokens"] > 512, again
    # Whole pages come from the cache the second time (vLLM recomputes at least the last token).
    assert again["prompt_tokens_details"]["cached_tokens"] >= 512, (first, again)


def test_json_schema_output_is_strict_json(srv: Server) -> None:
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]}},
              "required": ["colour"], "additionalProperties": False}
    body = {**_body(40), "stream": False, "ignore_eos": False, "temperature": 1.0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}}}
    for seed in range(3):
        r = httpx.post(srv.base_url + "/v1/chat/completions", json={**body, "seed": seed}, timeout=120)
        assert r.status_code == 200, r.text
        assert json.loads(r.json()["choices"][0]["message"]["content"])["colour"] in ("red", "blue")


WEATHER_ARGS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                "unit": {"type": "string", "enum": ["c", "f"]}},
                "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": WEATHER_ARGS}}


def _sse_events(r: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]


def test_responses_answers_streamed_and_not(srv: Server) -> None:
    body = {"model": MODEL, "input": "What colour is the sky?", "max_output_tokens": 12, "temperature": 0}
    r = httpx.post(srv.base_url + "/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    done = r.json()
    assert done["status"] == "incomplete" and done["incomplete_details"]["reason"] == "max_output_tokens", done
    [message] = [item for item in done["output"] if item["type"] == "message"]
    text = "".join(part["text"] for part in message["content"] if part["type"] == "output_text")
    assert text and done["usage"]["output_tokens"] == 12
    with httpx.stream("POST", srv.base_url + "/v1/responses", json={**body, "stream": True}, timeout=120) as s:
        assert s.status_code == 200
        events = _sse_events(s)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete", kinds
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert streamed == text  # greedy: the same text both ways
    # Stored: the response reads back by id.
    back = httpx.get(f"{srv.base_url}/v1/responses/{done['id']}", timeout=10)
    assert back.status_code == 200 and back.json()["output"] == done["output"]


def test_a_required_tool_call_has_arguments_that_validate(srv: Server) -> None:
    # The parent renders the prompt and forces the call with its grammar (the
    # tiny template has no tools: the generic format); vLLM enforces it. The
    # tiny vocab spells JSON nearly a byte a token: a call takes about 80.
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER],
            "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 200, "temperature": 1.0}
    for seed in range(2):
        r = httpx.post(srv.base_url + "/v1/chat/completions", json={**body, "seed": seed}, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER_ARGS)
    # The same through the Responses API, streamed: a function_call item.
    tool = {"type": "function", **WEATHER["function"]}  # type: ignore[dict-item]
    rbody = {"model": MODEL, "input": "Weather in Oslo?", "tools": [tool], "tool_choice": "required",
             "parallel_tool_calls": False, "max_output_tokens": 200, "stream": True}
    with httpx.stream("POST", srv.base_url + "/v1/responses", json=rbody, timeout=120) as s:
        assert s.status_code == 200
        events = _sse_events(s)
    final = events[-1]
    assert final["type"] == "response.completed", final
    [item] = final["response"]["output"]
    assert item["type"] == "function_call" and item["name"] == "get_weather", item
    jsonschema.validate(json.loads(item["arguments"]), WEATHER_ARGS)


def test_a_peft_adapter_is_served_on_its_base(srv: Server) -> None:
    pair = f"{MODEL}:{ADAPTER}"
    models = {m["id"]: m for m in httpx.get(srv.base_url + "/v1/models", timeout=10).json()["data"]}
    assert models[pair]["parent"] == MODEL and models[pair]["state"] == "ready", models.get(pair)
    pid = srv.worker(MODEL)["pid"]

    def answer(model: str, **extra: Any) -> httpx.Response:
        return httpx.post(srv.base_url + "/v1/chat/completions",
                          json={**_body(24), "stream": False, "model": model, **extra}, timeout=120)

    base, adapted = answer(MODEL), answer(pair)
    assert base.status_code == 200 and adapted.status_code == 200, adapted.text
    text = [r.json()["choices"][0]["message"]["content"] for r in (base, adapted)]
    assert text[0] != text[1], text  # greedy both: the adapter changed the output
    assert answer(pair).json()["choices"][0]["message"]["content"] == text[1]
    # Scale 0 is the base alone; vLLM has no other scale than the adapter as trained.
    assert answer(pair, lora_scale=0).json()["choices"][0]["message"]["content"] == text[0]
    refused = answer(pair, lora_scale=0.5)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_request", refused.text
    assert srv.worker(MODEL)["pid"] == pid  # served by the one worker, never reloaded


def test_a_finetunes_adapter_is_served_from_the_outputs_dir_without_an_export(srv: Server) -> None:
    pair = f"{MODEL}:run1"
    listed = httpx.get(srv.base_url + "/api/models", timeout=10).json()
    [adapter] = [a for a in listed["adapters"] if a["id"] == "run1"]
    assert adapter["usable"] and [(lk["model"], lk["fits"]) for lk in adapter["links"]] == [(pair, True)]
    assert not any(p.suffix == ".gguf" for p in srv.models_dir.iterdir())  # nothing was exported

    def answer(model: str) -> str:
        r = httpx.post(srv.base_url + "/v1/chat/completions",
                       json={**_body(24), "stream": False, "model": model}, timeout=120)
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["message"]["content"])

    assert answer(pair) != answer(MODEL)  # greedy both: the adapter changed the output
    assert answer(pair) != answer(f"{MODEL}:{ADAPTER}")  # and it is this adapter, not the other one


def test_an_image_to_a_text_only_hf_model_is_refused_naming_it(srv: Server) -> None:
    image = "data:image/png;base64," + base64.b64encode(png(8, 8, (200, 30, 30))).decode()
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": image}}]
    r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("vision_unavailable", "messages[0].content[1]"), err
    assert srv.worker(MODEL)["state"] == "ready"


# A vLLM start beside two running engines on a busy 2-core machine was seen
# to take over 4 minutes: the request that starts one gets a coarse bound.
START_S = 500


@pytest.mark.timeout(START_S + 60)
def test_embeddings_through_the_pooling_runner(srv: Server) -> None:
    # A second worker, in embedding mode, beside the generation worker; the first request starts it.
    url = srv.base_url + "/v1/embeddings"
    r = httpx.post(url, json={"model": MODEL, "input": ["hello world", "tiny model", "hello world"]},
                   timeout=START_S)
    assert r.status_code == 200, r.text
    body = r.json()
    vectors = [d["embedding"] for d in body["data"]]
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert all(len(v) == 256 for v in vectors)  # the tiny model's hidden size
    for v in vectors:
        assert abs(sum(x * x for x in v) ** 0.5 - 1.0) < 1e-3  # normalised
    assert vectors[0] == pytest.approx(vectors[2], abs=1e-5) and vectors[0] != pytest.approx(vectors[1], abs=1e-3)
    assert body["usage"]["prompt_tokens"] > 3
    too_long = httpx.post(url, json={"model": MODEL, "input": "hello " * (N_CTX * 2)}, timeout=60)
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded", too_long.text
    # The generation worker serves on, untouched.
    assert srv.worker(MODEL)["state"] == "ready"


@pytest.mark.timeout(4 * START_S + 60)
def test_a_hub_cache_snapshot_serves_and_drafts_with_the_same_text(srv: Server) -> None:
    models = {m["id"]: m for m in httpx.get(srv.base_url + "/v1/models", timeout=10).json()["data"]}
    assert (models[HUB_MODEL]["engine"], models[HUB_MODEL]["state"]) == ("vllm", "unloaded"), models.get(HUB_MODEL)
    item = httpx.get(f"{srv.base_url}/api/models/{HUB_MODEL}", timeout=10).json()
    assert (item["kind"], item["source"], item["n_layer"]) == ("hf", "hf_cache", 2), item
    # Repeats in the prompt and a long answer give prompt lookup n-grams to find.
    body = {**_body(160, "one two three one two three one two three one two three"), "stream": False}
    try:
        r = httpx.post(srv.base_url + "/v1/chat/completions", json={**body, "model": HUB_MODEL}, timeout=START_S)
        assert r.status_code == 200, r.text
        # The same weights as MODEL's dir, which drafts nothing: greedy, the
        # target verifies every drafted token, so the answer is the same.
        same = httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=120)
        assert r.json()["choices"][0]["message"]["content"] == same.json()["choices"][0]["message"]["content"]
        assert r.json()["usage"]["completion_tokens"] == 160
        # It did draft: vLLM's counts reach /api/models with the heartbeat.
        state = srv.wait_worker(lambda w: bool(w["stats"]) and w["stats"]["draft_tokens"] > 0, HUB_MODEL,
                                timeout=30)["stats"]
        assert 0 <= state["draft_accepted"] <= state["draft_tokens"], state
        shown = httpx.get(f"{srv.base_url}/api/models/{HUB_MODEL}", timeout=10).json()["speculative"]
        assert (shown["mode"], shown["draft_max"], shown["error"]) == ("ngram", DRAFT_MAX, None), shown
        assert shown["draft_tokens"] >= state["draft_tokens"], shown  # counts since the start, read later
        assert srv.worker(MODEL)["stats"]["draft_tokens"] == 0
        plain = same.json()["choices"][0]["message"]["content"]
        _drafts_with_a_draft_model(srv, body, plain)
        _drafts_with_an_eagle_head(srv, body, plain, HEAD, "eagle")
        _drafts_with_an_eagle_head(srv, body, plain, HEAD3, "eagle3")
    finally:  # one vLLM worker less for the tests after this one
        httpx.post(f"{srv.base_url}/api/models/{HUB_MODEL}/unload", timeout=60)


def _drafts_with_a_draft_model(srv: Server, body: dict[str, Any], plain: str) -> None:
    """HUB_MODEL reloaded with MODEL's dir drafting for it: the same weights,
    so the drafts are the target's own greedy choices and most are kept.
    The fit holds the draft's KV pages beside the target's (1 KiB a token each)."""
    state, item = _reloaded_to_draft(srv, body, plain, MODEL, 2048)
    assert state["draft_tokens"] / 2 < state["draft_accepted"], state
    assert item["speculative"]["mode"] == "draft", item["speculative"]


def _drafts_with_an_eagle_head(srv: Server, body: dict[str, Any], plain: str, head: str, method: str) -> None:
    """HUB_MODEL reloaded with ``head`` drafting for it (vLLM's ``method``,
    "eagle" or "eagle3"): a random head's drafts are mostly refused, and the
    text stays the target's. The head is listed, but not as a model of its
    own; its one layer takes 0.5 KiB of KV a token beside the target's 1 KiB."""
    models = {m["id"]: m for m in httpx.get(srv.base_url + "/api/models", timeout=10).json()["data"]}
    kind = {"eagle": "an EAGLE draft head", "eagle3": "an EAGLE-3 draft head"}[method]
    assert not models[head]["usable"] and kind in models[head]["reason"], models[head]
    _state, item = _reloaded_to_draft(srv, body, plain, head, 1536)
    assert item["speculative"]["mode"] == method, item["speculative"]


def _reloaded_to_draft(srv: Server, body: dict[str, Any], plain: str, drafter: str,
                       kv_per_token: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """HUB_MODEL reloaded with ``drafter`` drafting 3 tokens a step: the same
    greedy text, drafts counted (since this worker's start), and the fit's KV
    budget at ``kv_per_token`` bytes, which vLLM counts as as many tokens
    (with the page its block pool holds back). Its stats and /api/models item."""
    pid = srv.worker(HUB_MODEL)["pid"]
    r = httpx.post(f"{srv.base_url}/api/models/{HUB_MODEL}/load", timeout=START_S,
                   json={"speculative": "draft", "draft_model": drafter, "draft_max": 3})
    assert r.status_code == 200, r.text
    srv.wait_worker(lambda w: w["state"] == "ready" and w["pid"] != pid, HUB_MODEL, timeout=START_S)
    r = httpx.post(srv.base_url + "/v1/chat/completions", json={**body, "model": HUB_MODEL}, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == plain, r.text
    state = srv.wait_worker(lambda w: bool(w["stats"]) and w["stats"]["draft_tokens"] > 0, HUB_MODEL,
                            timeout=30)["stats"]
    assert 0 <= state["draft_accepted"] <= state["draft_tokens"], state
    item = httpx.get(f"{srv.base_url}/api/models/{HUB_MODEL}", timeout=10).json()
    shown = item["speculative"]
    assert (shown["draft_model"], shown["draft_max"]) == (drafter, 3), shown
    assert_budget(srv, HUB_MODEL, item, kv_per_token, n_ctx=N_CTX)
    return dict(state), dict(item)


def test_drafting_vllm_cannot_do_is_refused_before_any_start(srv: Server) -> None:
    pid = srv.worker(MODEL)["pid"]

    def load(body: dict[str, Any]) -> dict[str, Any]:
        r = httpx.post(f"{srv.base_url}/api/models/{MODEL}/load", json=body, timeout=60)
        assert r.status_code in (400, 404), r.text
        return dict(r.json()["error"])

    err = load({"speculative": "mtp"})  # a Llama has no MTP layers
    assert (err["code"], err["param"]) == ("mtp_unavailable", "speculative"), err
    err = load({"speculative": "draft", "draft_model": "no-such-model"})
    assert (err["code"], err["param"]) == ("model_not_found", "draft_model"), err
    err = load({"speculative": "draft", "draft_model": OTHER_VOCAB})
    assert (err["code"], err["param"]) == ("draft_vocab_mismatch", "draft_model"), err
    assert "tokenizer.json" in err["message"], err
    err = load({"speculative": "draft", "draft_model": MODEL})
    assert (err["code"], err["param"]) == ("draft_unusable", "draft_model"), err
    assert srv.worker(MODEL)["pid"] == pid and srv.worker(MODEL)["state"] == "ready"


def test_last_the_engine_processes_die_with_the_parent(srv: Server) -> None:
    """(Last in this module: it kills the module's server.) vLLM's engine core
    is the worker's child: a SIGKILLed parent leaves none of them behind."""
    worker = psutil.Process(int(srv.worker(MODEL)["pid"]))
    tree = [worker, *worker.children(recursive=True)]
    assert any("EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline()) for p in tree[1:]), tree
    srv.stop(signal.SIGKILL)
    _gone, alive = psutil.wait_procs(tree, timeout=30)
    assert not alive, alive
