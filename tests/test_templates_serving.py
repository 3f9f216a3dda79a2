"""Chat templates on real workers: a GGUF without one is prompted in its
family's turns, ``/api/models`` says where each model's template came from,
an override file replaces the model's own, and a request's template
variables (``chat_template_kwargs``, ``enable_thinking``, a model's
thinking default) reach the render.

What the model read is told by the prompt's token count: the chat's equals
that of the expected text sent as a raw completion, whose markers the tiny
vocabs hold as single tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.models.demo import CHATML_TEMPLATE, write_tiny_gguf
from tests.server import Server, running, short_tempdir
from tests.tiny_models import write_tiny_gemma3

GEMMA_MARKERS = ("<start_of_turn>", "<end_of_turn>")
LLAMA3_MARKERS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
# Prints the request's variables: one of its own, and enable_thinking's state.
OVERRIDE = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
            "[{{ flavor | default('plain') }}|"
            "{% if enable_thinking is defined %}{{ 'think' if enable_thinking else 'nothink' }}"
            "{% else %}unset{% endif %}]")
ASK: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    models = short_tempdir("gvt")
    write_tiny_gemma3(models / "gemma.gguf", n_layer=2, n_ctx=2048, chat_template=None, specials=GEMMA_MARKERS)
    write_tiny_gguf(models / "llama3.gguf", chat_template=None, specials=LLAMA3_MARKERS)
    write_tiny_gguf(models / "llama2.gguf", chat_template=None)
    write_tiny_gguf(models / "own.gguf")
    write_tiny_gguf(models / "ovr.gguf")
    (models / "good.jinja").write_text("{{ messages[-1]['content'] }}<<override>>")
    (models / "broken.jinja").write_text("{% if %}")
    state = short_tempdir("gvts")
    files = tmp_path_factory.mktemp("templates")
    (files / "override.jinja").write_text(OVERRIDE)
    (state / "config.toml").write_text(
        f'[model_defaults.ovr]\nchat_template_file = "{files / "override.jinja"}"\nenable_thinking = false\n')
    with running(Server(models, state_dir=state, model="own")) as server:
        yield server


def api_model(srv: Server, model: str) -> dict[str, Any]:
    found: dict[str, Any] = httpx.get(f"{srv.base_url}/api/models/{model}", timeout=30).json()
    return found


def chat_prompt_tokens(srv: Server, model: str, messages: Any = ASK, **extra: Any) -> int:
    reply = httpx.post(f"{srv.base_url}/v1/chat/completions", timeout=120,
                       json={"model": model, "messages": messages, "max_tokens": 1, **extra})
    assert reply.status_code == 200, reply.text
    tokens: int = reply.json()["usage"]["prompt_tokens"]
    return tokens


def text_tokens(srv: Server, model: str, text: str) -> int:
    """How many tokens ``model`` reads for ``text`` (legacy completions count it)."""
    reply = httpx.post(f"{srv.base_url}/v1/completions", timeout=120,
                       json={"model": model, "prompt": text, "max_tokens": 1})
    assert reply.status_code == 200, reply.text
    tokens: int = reply.json()["usage"]["prompt_tokens"]
    return tokens


def test_the_library_says_what_it_knows_before_a_load(srv: Server) -> None:
    assert api_model(srv, "gemma")["chat_template"] == {"source": "architecture", "name": "gemma", "file": None}
    assert api_model(srv, "own")["chat_template"]["source"] == "file"
    ovr = api_model(srv, "ovr")["chat_template"]
    assert ovr["source"] == "override" and ovr["file"].endswith("override.jinja")


def test_a_gemma_without_a_template_is_prompted_in_gemma_turns(srv: Server) -> None:
    expected = "<start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\n"
    chatml = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    got = chat_prompt_tokens(srv, "gemma")
    assert got == text_tokens(srv, "gemma", expected)
    # Not the ChatML prompt of before (the demo vocab holds its markers too).
    assert got < text_tokens(srv, "gemma", chatml)
    assert api_model(srv, "gemma")["chat_template"] == {"source": "architecture", "name": "gemma", "file": None}


def test_a_llama_vocab_tells_llama3_from_llama2(srv: Server) -> None:
    # Before its worker reads the vocab, a llama GGUF's format is not known.
    assert api_model(srv, "llama3")["chat_template"]["source"] is None
    expected = ("<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert chat_prompt_tokens(srv, "llama3") == text_tokens(srv, "llama3", expected)
    assert api_model(srv, "llama3")["chat_template"] == {"source": "architecture", "name": "llama3", "file": None}
    llama2 = "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi there [/INST]"
    assert chat_prompt_tokens(srv, "llama2") == text_tokens(srv, "llama2", llama2)
    assert api_model(srv, "llama2")["chat_template"]["name"] == "llama2"


def test_the_override_file_and_the_kwargs_reach_the_template(srv: Server) -> None:
    hi = [{"role": "user", "content": "Hi there"}]
    # The model's thinking default (enable_thinking = false) fills what the request leaves unset.
    assert chat_prompt_tokens(srv, "ovr", hi) == text_tokens(srv, "ovr", "Hi there[plain|nothink]")
    assert api_model(srv, "ovr")["chat_template"]["source"] == "override"
    assert chat_prompt_tokens(srv, "ovr", hi, chat_template_kwargs={"flavor": "sea salt"}, enable_thinking=True) == (
        text_tokens(srv, "ovr", "Hi there[sea salt|think]"))
    assert chat_prompt_tokens(srv, "ovr", hi, chat_template_kwargs={"enable_thinking": True}) == (
        text_tokens(srv, "ovr", "Hi there[plain|think]"))
    # reasoning_effort does not reach a template that has no toggle; the default holds.
    responses = httpx.post(f"{srv.base_url}/v1/responses", timeout=120, json={
        "model": "ovr", "input": "Hi there", "max_output_tokens": 1, "store": False,
        "chat_template_kwargs": {"flavor": "lime"}})
    assert responses.status_code == 200, responses.text
    assert responses.json()["usage"]["input_tokens"] == text_tokens(srv, "ovr", "Hi there[lime|nothink]")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
def test_bad_kwargs_are_a_400_naming_the_field(srv: Server, path: str) -> None:
    body: dict[str, Any] = {"model": "ovr", "max_tokens": 1} if "chat" in path else {"model": "ovr", "input": "x"}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": "x"}]
    for extra, param in [({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
                         ({"chat_template_kwargs": {"big": "x" * 20_000}}, "chat_template_kwargs"),
                         ({"chat_template_kwargs": "on"}, "chat_template_kwargs"),
                         ({"enable_thinking": "yes"}, "enable_thinking"),
                         ({"enable_thinking": False, "chat_template_kwargs": {"enable_thinking": True}},
                          "enable_thinking")]:
        reply = httpx.post(srv.base_url + path, json={**body, **extra}, timeout=30)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == param, reply.text


def test_a_load_takes_an_override_from_the_library_folder(srv: Server) -> None:
    def load(body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{srv.base_url}/api/models/own/load", json=body, timeout=120)

    for body, message in [({"chat_template_file": "/etc/hostname"}, "inside models_dir"),
                          ({"chat_template_file": "../outside.jinja"}, "inside models_dir"),
                          ({"chat_template_file": "broken.jinja"}, "not a valid Jinja template"),
                          ({"chat_template_file": "absent.jinja"}, "is not a file")]:
        reply = load(body)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == "chat_template_file" and message in error["message"], error
    reply = load({"chat_template_file": "good.jinja"})
    assert reply.status_code == 200, reply.text
    view = api_model(srv, "own")["chat_template"]
    assert view["source"] == "override" and Path(view["file"]).name == "good.jinja"
    assert chat_prompt_tokens(srv, "own", ASK) == text_tokens(srv, "own", "Hi there<<override>>")
