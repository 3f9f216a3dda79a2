"""Images on a vLLM worker, through the real server: a tiny random BLIP-2
(tests/tiny_blip2.py, built here with no download) takes a chat's image and
a Responses ``input_image``, is listed as vision-capable, and refuses broken
images and more images than it takes with 400s; a text-only hf model still
refuses images before any load.

One vLLM start for the module (the BLIP-2's): the text-only model's refusal
comes from the parent, before its worker would start. Needs the vLLM
environment (``make install-vllm``) and the train extra."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from supervisor.config import default_vllm_python
from tests.server import Server, running, short_tempdir

pytest.importorskip("transformers", reason="needs the train extra")
VLLM_PYTHON = default_vllm_python()
if not VLLM_PYTHON:
    pytest.skip("no vLLM environment (make install-vllm)", allow_module_level=True)

from tests.tiny_blip2 import QUERY_TOKENS, build_tiny_blip2
from tests.tiny_hf import build_vllm_model
from tests.tiny_vision import png

# A vLLM start on a busy 2-core machine has taken minutes: coarse bounds.
START_S = 500
pytestmark = pytest.mark.timeout(START_S + 120)
MODEL = "tiny-blip2"
TEXT_MODEL = "tiny-text-hf"
RED, BLUE = (220, 20, 20), (20, 20, 220)


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    models = short_tempdir("gvi")
    build_tiny_blip2(models / MODEL)
    build_vllm_model(models / TEXT_MODEL)
    env = {"GPUVISOR_VLLM_PYTHON": VLLM_PYTHON, "GPUVISOR_PARALLEL": "1", "GPUVISOR_N_CTX": "256"}
    with running(Server(models, env=env, model=MODEL)) as server:
        yield server


def _listed(srv: Server) -> dict[str, dict[str, Any]]:
    return {m["id"]: m for m in httpx.get(srv.base_url + "/v1/models", timeout=10).json()["data"]}


def test_listed_as_vision_capable_before_and_after_its_load(srv: Server) -> None:
    # Before any load: from config.json (BLIP-2 declares a vision tower).
    listed = _listed(srv)
    assert (listed[MODEL]["engine"], listed[MODEL]["vision"]) == ("vllm", True)
    assert listed[TEXT_MODEL]["vision"] is False
    assert httpx.get(f"{srv.base_url}/api/models/{MODEL}", timeout=10).json()["vision"] is True
    r = httpx.post(f"{srv.base_url}/api/models/{MODEL}/load", timeout=START_S)
    assert r.status_code == 200, r.text
    srv.wait_worker(lambda w: w["state"] == "ready", MODEL, timeout=START_S)
    # Once loaded: what the worker reports (vLLM serves it as multimodal).
    item = httpx.get(f"{srv.base_url}/api/models/{MODEL}", timeout=10).json()
    assert (item["vision"], item["vision_error"]) == (True, None)
    assert _listed(srv)[MODEL]["vision"] is True
    # Prompted as vLLM prompts BLIP-2, with its own fallback template.
    assert item["chat_template"]["name"] == "vllm-blip-2"


def _chat(srv: Server, image: bytes | None, **extra: Any) -> httpx.Response:
    content: list[dict[str, Any]] = [{"type": "text", "text": "What colour is it?"}]
    if image is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": _url(image)}})
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 5,
            "messages": [{"role": "user", "content": content}], **extra}
    return httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=START_S)


def _first_token(body: dict[str, Any]) -> dict[str, float]:
    first = body["choices"][0]["logprobs"]["content"][0]
    return {t["token"]: round(t["logprob"], 3) for t in first["top_logprobs"]}


def test_the_image_reaches_the_model(srv: Server) -> None:
    red, blue, red_again = (_chat(srv, png(16, 16, c)) for c in (RED, BLUE, RED))
    for r in (red, blue, red_again):
        assert r.status_code == 200, r.text
    # Greedy on the same image: the same first-token distribution; on another
    # colour a different one, so the pixels reached the model.
    assert _first_token(red.json()) == _first_token(red_again.json())
    assert _first_token(red.json()) != _first_token(blue.json())
    # The image is in the prompt vLLM ran: its query tokens beside the text's.
    text_only = _chat(srv, None)
    assert text_only.status_code == 200, text_only.text
    assert red.json()["usage"]["prompt_tokens"] == text_only.json()["usage"]["prompt_tokens"] + QUERY_TOKENS


def test_responses_takes_an_input_image(srv: Server) -> None:
    def ask(rgb: tuple[int, int, int]) -> dict[str, Any]:
        r = httpx.post(srv.base_url + "/v1/responses", timeout=START_S, json={
            "model": MODEL, "max_output_tokens": 4, "temperature": 0, "top_logprobs": 5,
            "include": ["message.output_text.logprobs"],
            "input": [{"role": "user", "content": [
                {"type": "input_image", "image_url": _url(png(16, 16, rgb))},
                {"type": "input_text", "text": "What colour is it?"}]}]})
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        assert body["status"] in ("completed", "incomplete"), body
        return body

    red, blue = ask(RED), ask(BLUE)
    chat = _chat(srv, png(16, 16, RED)).json()
    # The same prompt as the chat's: the image's query tokens are counted.
    assert red["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]

    def first(body: dict[str, Any]) -> dict[str, float]:
        part = next(p for item in body["output"] if item["type"] == "message" for p in item["content"])
        return {t["token"]: round(t["logprob"], 3) for t in part["logprobs"][0]["top_logprobs"]}

    # The colour changes the first token's distribution here as in the chat.
    assert first(red) == _first_token(chat)
    assert first(red) != first(blue)


def test_broken_images_are_400s_and_the_worker_serves_on(srv: Server) -> None:
    good = png(16, 16, RED)
    # Not an image at all: the parent refuses it by its bytes.
    r = _chat(srv, b"this is not an image at all")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages[0].content[0]"
    # A valid header over a cut body: the worker's decode refuses it.
    r = _chat(srv, good[: len(good) - 30])
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_image", r.text
    # BLIP-2 takes one image a prompt: two are a 400 naming the limit.
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _url(good)}},
        {"type": "image_url", "image_url": {"url": _url(png(16, 16, BLUE))}},
        {"type": "text", "text": "Which?"}]}]}
    r = httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=START_S)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "too_many_images", r.text
    assert "at most 1" in r.json()["error"]["message"]
    assert srv.worker(MODEL)["state"] == "ready"
    assert _chat(srv, good).status_code == 200


def test_a_text_only_hf_model_still_refuses_images_before_any_load_in_chat_and_responses(srv: Server) -> None:
    content = [{"type": "text", "text": "What is this?"},
               {"type": "image_url", "image_url": {"url": _url(png(8, 8, RED))}}]
    r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=60, json={
        "model": TEXT_MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("vision_unavailable", "messages[0].content[1]"), err
    assert "vision tower" in err["message"]
    r = httpx.post(srv.base_url + "/v1/responses", timeout=60, json={
        "model": TEXT_MODEL, "max_output_tokens": 4, "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "What is this?"},
            {"type": "input_image", "image_url": _url(png(8, 8, RED))}]}]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("vision_unavailable", "input[0].content[1]"), err
    with pytest.raises(KeyError):
        srv.worker(TEXT_MODEL)  # refused before its worker was started
