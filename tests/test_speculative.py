"""Speculative decoding through the real server: each mode changes speed,
never the greedy text; bad drafting settings are refused naming the setting;
a draft model the engine cannot load fails the load cleanly."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.models.demo import write_tiny_gguf
from tests.server import Server, poll_until, running, short_tempdir
from tests.tiny_mtp import write_tiny_mtp

BODY = {"model": "tiny", "temperature": 0, "max_tokens": 48, "ignore_eos": True,
        # Longer than one prefill batch (512 tokens): drafting keeps every
        # position's logits, which once overflowed a batch-sized buffer.
        "messages": [{"role": "user", "content": " ".join(["the model"] * 70)}]}


@pytest.fixture(scope="module")
def srv(tiny_model_path: Path) -> Iterator[Server]:
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    # Same vocabulary, fewer layers, other weights: a draft that mostly disagrees.
    write_tiny_gguf(models / "tiny-draft.gguf", seed=7, n_layer=1)
    # 200 more tokens: a vocabulary the engine would refuse too.
    write_tiny_gguf(models / "other-vocab.gguf", seed=7, n_layer=1, extra_tokens=400)
    real = tiny_model_path.read_bytes()
    # Tensor data cut off: the library's header check finds it.
    (models / "cut-draft.gguf").write_bytes(real[: len(real) // 2])
    # An architecture the engine does not know, with the same vocabulary:
    # only the engine finds out, when it loads the draft.
    arch = b"general.architecture" + struct.pack("<IQ", 8, 5)
    (models / "odd-draft.gguf").write_bytes(real.replace(arch + b"llama", arch + b"llamz", 1))
    # A model with one MTP (NextN) layer, which the engine can draft with.
    write_tiny_mtp(models / "tiny-mtp.gguf")
    with running(Server(models, model="tiny")) as server:
        yield server


def answer(srv: Server, model: str = "tiny") -> str:
    r = httpx.post(srv.base_url + "/v1/chat/completions", json={**BODY, "model": model}, timeout=120)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def load(srv: Server, body: dict[str, Any], model: str = "tiny") -> httpx.Response:
    return httpx.post(srv.base_url + f"/api/models/{model}/load", json=body, timeout=120)


def reload(srv: Server, body: dict[str, Any], model: str = "tiny") -> None:
    pid = srv.worker(model)["pid"] if any(w["model"] == model for w in srv.workers()) else None
    r = load(srv, body, model)
    assert r.status_code == 200, r.text
    srv.wait_worker(lambda w: w["state"] == "ready" and w["pid"] != pid, model=model)


def speculative(srv: Server, model: str = "tiny") -> dict[str, Any]:
    info: dict[str, Any] = httpx.get(srv.base_url + f"/api/models/{model}", timeout=10).json()
    return dict(info["speculative"])


def error_of(r: httpx.Response) -> dict[str, Any]:
    err: dict[str, Any] = r.json()["error"]
    return err


MODES: list[tuple[dict[str, Any], str]] = [
    ({"draft_ngram": 4}, "ngram"),  # the older spelling
    ({"speculative": "ngram", "draft_max": 6}, "ngram"),
    ({"speculative": "draft", "draft_model": "tiny-draft", "draft_max": 4}, "draft"),
    ({"speculative": "auto", "draft_model": "tiny-draft", "draft_min": 1, "draft_max": 3}, "draft"),
]


def test_each_mode_keeps_greedy_output(srv: Server) -> None:
    reload(srv, {"speculative": "off"})
    plain = answer(srv)
    assert speculative(srv)["mode"] == "off"
    for body, mode in MODES:
        reload(srv, body)
        assert answer(srv) == plain, body
        state = speculative(srv)
        assert state["mode"] == mode and state["error"] is None, state
        assert state["draft_max"] == (body.get("draft_max") or body.get("draft_ngram")), state
    # A draft model drafts on every step: the counters moved (the worker
    # reports them with its heartbeat), and /metrics shows them.
    state = poll_until(lambda: speculative(srv), lambda s: bool(s["draft_tokens"]))
    assert state["draft_model"] == "tiny-draft" and state["draft_tokens"] > 0, state
    assert 0 <= state["draft_accepted"] <= state["draft_tokens"], state
    assert state["acceptance_rate"] == pytest.approx(state["draft_accepted"] / state["draft_tokens"])
    text = httpx.get(srv.base_url + "/metrics", timeout=10).text
    assert f'gpuvisor_speculative_draft_tokens_total{{model="tiny",speculative="draft"}} ' \
           f'{float(state["draft_tokens"])}' in text, text
    assert 'gpuvisor_speculative_acceptance_ratio{model="tiny",speculative="draft"}' in text


def test_concurrent_drafted_requests_keep_their_text(srv: Server) -> None:
    prompts = [" ".join(["the model"] * 40), " ".join(["hello world"] * 25), "a tiny random demo"]

    def ask(prompt: str) -> str:
        r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=120, json={
            **BODY, "messages": [{"role": "user", "content": prompt}]})
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["message"]["content"])

    reload(srv, {"speculative": "off"})
    plain = [ask(p) for p in prompts]
    reload(srv, {"speculative": "draft", "draft_model": "tiny-draft", "draft_max": 4, "parallel": 3})
    with ThreadPoolExecutor(len(prompts)) as pool:
        drafted = list(pool.map(ask, prompts))
    assert drafted == plain


def test_mtp_keeps_greedy_output(srv: Server) -> None:
    reload(srv, {"speculative": "off"}, "tiny-mtp")
    plain = answer(srv, "tiny-mtp")
    for body in ({"speculative": "mtp", "draft_max": 2}, {"speculative": "auto"}):
        reload(srv, body, "tiny-mtp")
        assert answer(srv, "tiny-mtp") == plain, body
        assert speculative(srv, "tiny-mtp")["mode"] == "mtp"
    state = poll_until(lambda: speculative(srv, "tiny-mtp"), lambda s: bool(s["draft_tokens"]))
    assert state["draft_model"] is None and 0 <= state["draft_accepted"] <= state["draft_tokens"], state
    # Unloaded: the other tests see one worker.
    httpx.post(srv.base_url + "/api/models/tiny-mtp/unload", timeout=60).raise_for_status()


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"speculative": "draft", "draft_model": "no-such-model"}, 404, "draft_model"),
    ({"speculative": "draft"}, 400, "draft_model"),
    ({"speculative": "mtp"}, 400, "speculative"),  # the tiny model has no MTP layers
    ({"speculative": "sometimes"}, 400, "speculative"),
    ({"speculative": "ngram", "draft_min": 5, "draft_max": 2}, 400, "draft_min"),
    ({"speculative": "ngram", "draft_max": 0}, 400, "draft_max"),
    ({"speculative": "draft", "draft_model": "tiny-draft", "draft_ngram": 4}, 400, "draft_ngram"),
    ({"draft_ngram": 4, "draft_max": 2}, 400, "draft_ngram"),
    ({"draft_ngram": 65}, 400, "draft_ngram"),
])
def test_bad_settings_are_refused_naming_the_setting(srv: Server, body: dict[str, Any], status: int,
                                                      param: str) -> None:
    r = load(srv, body)
    assert r.status_code == status, r.text
    assert error_of(r)["param"] == param, r.text


def test_vocab_mismatch_is_refused_and_shown(srv: Server) -> None:
    reload(srv, {"speculative": "off"})
    pid = srv.worker()["pid"]
    r = load(srv, {"speculative": "draft", "draft_model": "other-vocab"})
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == "draft_model" and err["code"] == "draft_vocab_mismatch", err
    info = httpx.get(srv.base_url + "/api/models/tiny", timeout=10).json()
    assert info["speculative"]["error"] == err["message"], info
    # Refused before anything was stopped: the loaded worker still serves.
    assert srv.worker()["pid"] == pid and srv.worker()["state"] == "ready"
    answer(srv)
    # A later good load clears the reason.
    reload(srv, {"speculative": "draft", "draft_model": "tiny-draft"})
    assert speculative(srv)["error"] is None


def test_an_unreadable_draft_is_refused(srv: Server) -> None:
    r = load(srv, {"speculative": "draft", "draft_model": "cut-draft"})
    assert r.status_code == 400, r.text
    assert error_of(r)["param"] == "draft_model" and error_of(r)["code"] == "draft_unusable", r.text


def test_a_draft_the_engine_cannot_load_fails_the_load_cleanly(srv: Server) -> None:
    r = load(srv, {"speculative": "draft", "draft_model": "odd-draft"})
    assert r.status_code == 200, r.text
    # Exit code 3 (cannot load): failed at once, never restarted.
    w = srv.wait_worker(lambda w: w["state"] == "failed", timeout=60)
    assert w["restarts"] == 0 and "odd-draft.gguf" in (w["reason"] or ""), w
    r = httpx.post(srv.base_url + "/v1/chat/completions", json=BODY, timeout=60)
    assert r.status_code == 503 and error_of(r)["code"] == "model_failed", r.text
    # Loading again without the draft serves.
    reload(srv, {"speculative": "off"})
    answer(srv)
