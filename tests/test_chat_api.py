"""The OpenAI-compatible routes through the official client, on a real server."""

from __future__ import annotations

import json
import math
import time

import httpx
import openai
import pytest

from tests.server import Server


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def test_models_lists_the_model_as_ready(server: Server, client: openai.OpenAI) -> None:
    models = {m.id: m for m in client.models.list()}
    assert server.model in models
    assert models[server.model].model_extra["state"] == "ready"  # type: ignore[index]


def test_chat_is_deterministic_at_temperature_zero(server: Server, client: openai.OpenAI) -> None:
    kwargs = dict(model=server.model, messages=[{"role": "user", "content": "Say hello"}],
                  temperature=0, max_tokens=24, extra_body={"ignore_eos": True})
    first = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    second = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    assert first.choices[0].message.content == second.choices[0].message.content
    assert first.choices[0].message.role == "assistant"
    assert first.choices[0].finish_reason == "length"
    assert first.usage is not None
    assert first.usage.completion_tokens == 24
    # The prompt is the rendered ChatML conversation: well over the 2 words typed.
    assert first.usage.prompt_tokens > 5
    assert first.usage.total_tokens == first.usage.prompt_tokens + 24
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    # The same prompt again reuses the cached prefix in the worker.
    assert second.usage.prompt_tokens_details.cached_tokens > 0


def test_streamed_chat_matches_the_whole_reply(server: Server, client: openai.OpenAI) -> None:
    kwargs = dict(model=server.model, messages=[{"role": "user", "content": "Count"}],
                  temperature=0, max_tokens=30, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    chunks = list(client.chat.completions.create(  # type: ignore[call-overload]
        stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 30
    assert len({c.id for c in chunks}) == 1


def test_n_choices_whole_and_streamed(server: Server, client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "Pick a word"}]
    kwargs = dict(model=server.model, messages=msgs, max_tokens=12, extra_body={"ignore_eos": True})
    one = client.chat.completions.create(temperature=0, **kwargs)  # type: ignore[call-overload]
    # Sampled with a seed: the choices differ from each other, and the same
    # request gives the same choices again.
    sampled = client.chat.completions.create(n=3, temperature=1.0, seed=7, **kwargs)  # type: ignore[call-overload]
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" and c.message.role == "assistant" for c in sampled.choices)
    texts = [c.message.content for c in sampled.choices]
    assert len(set(texts)) > 1, texts
    assert sampled.usage is not None and one.usage is not None
    assert sampled.usage.completion_tokens == 36
    assert sampled.usage.prompt_tokens == one.usage.prompt_tokens, "the prompt counts once"
    # Greedy choices streamed: each index carries its own text, role and finish.
    greedy = client.chat.completions.create(n=2, temperature=0, **kwargs)  # type: ignore[call-overload]
    assert [c.message.content for c in greedy.choices] == [one.choices[0].message.content] * 2
    chunks = list(client.chat.completions.create(  # type: ignore[call-overload]
        n=2, temperature=0, stream=True, stream_options={"include_usage": True}, **kwargs))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == one.choices[0].message.content
        assert [c.finish_reason for c in mine if c.finish_reason] == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 24
    # Text completions take n too, and echo prefixes every choice.
    out = client.completions.create(model=server.model, prompt="Once", max_tokens=4, n=2, echo=True,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.text.startswith("Once") and len(c.text) > 4 for c in out.choices)
    for bad in (0, 9):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(n=bad, **kwargs)  # type: ignore[call-overload]
        assert err.value.body["param"] == "n"  # type: ignore[index]


def test_stop_string_ends_the_reply_before_it(server: Server, client: openai.OpenAI) -> None:
    base = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "go"}], temperature=0,
        max_tokens=40, extra_body={"ignore_eos": True})
    text = base.choices[0].message.content or ""
    assert len(text) > 6
    stop = text[4:6]
    cut = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "go"}], temperature=0,
        max_tokens=40, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_json_object_response_format_is_valid_json(server: Server, client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "json please"}],
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}},
        temperature=0, max_tokens=200)
    data = json.loads(reply.choices[0].message.content or "")
    assert isinstance(data["ok"], bool)


def test_text_completion(server: Server, client: openai.OpenAI) -> None:
    out = client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=8,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert out.object == "text_completion"
    assert out.usage is not None and out.usage.completion_tokens == 8
    assert out.choices[0].finish_reason == "length"
    streamed = client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=8,
                                         temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == out.choices[0].text


def test_embeddings_are_unit_vectors(server: Server, client: openai.OpenAI) -> None:
    out = client.embeddings.create(model=server.model, input=["hello world", "tiny model"])
    assert [d.index for d in out.data] == [0, 1]
    for d in out.data:
        assert len(d.embedding) == 64
        assert math.isclose(math.sqrt(sum(x * x for x in d.embedding)), 1.0, rel_tol=1e-3)
    assert out.data[0].embedding != out.data[1].embedding
    assert out.usage.prompt_tokens > 2
    floats = httpx.post(server.base_url + "/v1/embeddings", json={
        "model": server.model, "input": "hello world", "encoding_format": "float"}).json()
    assert floats["data"][0]["embedding"] == pytest.approx(out.data[0].embedding, abs=1e-6)


def _error(resp: httpx.Response, status: int) -> dict[str, object]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    assert {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]  # type: ignore[no-any-return]


def test_unknown_model_is_404_never_a_fallback(server: Server, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert info.value.code == "model_not_found"


def test_bad_input_gets_openai_shaped_errors(server: Server) -> None:
    url = server.base_url + "/v1/chat/completions"
    msgs = [{"role": "user", "content": "x"}]
    err = _error(httpx.post(url, json={"model": server.model, "messages": msgs, "temperature": "hot"}), 400)
    assert err["param"] == "temperature"
    err = _error(httpx.post(url, json={"model": server.model, "messages": [{"role": "wizard"}]}), 400)
    assert err["param"] == "messages[0].role"
    err = _error(httpx.post(url, json={"model": server.model, "messages": msgs, "temperature": 7}), 400)
    assert err["param"] == "temperature"
    err = _error(httpx.post(url, json={"messages": msgs}), 400)
    assert "model" in str(err["message"])
    err = _error(httpx.post(url, content=b"{not json", headers={"Content-Type": "application/json"}), 400)
    assert err["code"] == "invalid_json"
    _error(httpx.post(url, content=b"x" * (16 * 1024 * 1024 + 10)), 413)
    _error(httpx.get(server.base_url + "/v1/nothing-here"), 404)
    _error(httpx.get(url), 405)


def test_gzip_body_is_accepted(server: Server) -> None:
    import gzip
    body = gzip.compress(json.dumps({"model": server.model, "max_tokens": 2,
                                     "messages": [{"role": "user", "content": "x"}]}).encode())
    resp = httpx.post(server.base_url + "/v1/chat/completions", content=body,
                      headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})
    assert resp.status_code == 200, resp.text


def test_sse_headers(server: Server) -> None:
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json={
            "model": server.model, "stream": True, "max_tokens": 3,
            "messages": [{"role": "user", "content": "x"}]}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.headers["cache-control"] == "no-cache"
        assert resp.headers["x-accel-buffering"] == "no"
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"


def test_health_and_readiness(server: Server) -> None:
    health = httpx.get(server.base_url + "/healthz").json()
    assert health["status"] == "ok"
    assert httpx.get(server.base_url + "/readyz").status_code == 200


def test_zstd_body_is_accepted(server: Server) -> None:
    from backports import zstd

    body = zstd.compress(json.dumps({"model": server.model, "max_tokens": 2,
                                     "messages": [{"role": "user", "content": "x"}]}).encode())
    resp = httpx.post(server.base_url + "/v1/chat/completions", content=body,
                      headers={"Content-Encoding": "zstd", "Content-Type": "application/json"})
    assert resp.status_code == 200, resp.text


def test_worker_log_names_the_request_id(server: Server) -> None:
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=60,
                   headers={"X-Request-Id": "trace-worker-7f3a"},
                   json={"model": server.model, "max_tokens": 3,
                         "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    assert r.headers["X-Request-Id"] == "trace-worker-7f3a"
    # The worker's own log line for the request carries the same id.
    log_file = server.state_dir / "logs" / f"{server.model}.log"
    deadline = time.monotonic() + 10
    while "request trace-worker-7f3a: " not in log_file.read_text(errors="replace"):
        assert time.monotonic() < deadline, log_file.read_text(errors="replace")[-2000:]
        time.sleep(0.05)
    line = next(ln for ln in log_file.read_text(errors="replace").splitlines() if "trace-worker-7f3a" in ln)
    assert "prompt tokens" in line and "generated" in line
