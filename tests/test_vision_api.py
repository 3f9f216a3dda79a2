"""Images in through the HTTP API: a real server with a tiny model and its projector.

The models dir holds the tiny vision pair (``tiny-vl`` with its linked
``mmproj-tiny-vl.gguf``), a text-only model (``text/plain``) and a model
whose linked "projector" is no projector (``broken/bad``: vision fails to
load, text still serves). Requests go through the official SDK.
"""

from __future__ import annotations

import base64
import os
import signal
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from supervisor.models.library import ModelEntry
from supervisor.models.placement import PROJECTOR_COMPUTE_ALLOWANCE, projector_bytes
from tests.server import Server, running, short_tempdir
from tests.tiny_vision import gif, png, write_tiny_text_model, write_tiny_vision_pair
from worker.protocol import MAX_IMAGE_BYTES, MAX_IMAGES

pytestmark = pytest.mark.timeout(240)

RED = png(32, 32, (255, 0, 0))
NOISE = png(40, 24, seed=3)
MODEL = "tiny-vl"
TEXT_MODEL = "text/plain"
BROKEN = "broken/bad"


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    models = tmp_path_factory.mktemp("vision-models")
    write_tiny_vision_pair(models)
    (models / "text").mkdir()
    write_tiny_text_model(models / "text" / "plain.gguf", seed=1)
    (models / "broken").mkdir()
    write_tiny_text_model(models / "broken" / "bad.gguf", seed=2)
    # Named like a projector, but a text model: the worker refuses to load it as one.
    write_tiny_text_model(models / "broken" / "mmproj-bad.gguf", seed=3)
    with running(Server(models, state_dir=short_tempdir(), model=MODEL,
                        env={"GPUVISOR_N_CTX": "2048", "GPUVISOR_MAX_BODY_BYTES": str(40 << 20)})) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=120)


def _look(image: bytes, text: str = "look: ") -> list[dict[str, Any]]:
    return [{"role": "user", "content": [
        {"type": "text", "text": text},
        {"type": "image_url", "image_url": {"url": data_url(image), "detail": "low"}},
        {"type": "text", "text": " what is it?"}]}]


def _chat(client: openai.OpenAI, messages: list[dict[str, Any]], model: str = MODEL,
          **kw: Any) -> Any:
    return client.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                          temperature=0, max_tokens=10, **kw)


def _api_models(srv: Server) -> dict[str, dict[str, Any]]:
    return {m["id"]: m for m in httpx.get(srv.base_url + "/api/models", timeout=10).json()["data"]}


# ------------------------------------------------------------------- models


def test_models_say_vision_truthfully(srv: Server, client: openai.OpenAI) -> None:
    v1 = {m["id"]: m for m in httpx.get(srv.base_url + "/v1/models", timeout=10).json()["data"]}
    assert v1[MODEL]["vision"] is True and v1[TEXT_MODEL]["vision"] is False
    api = _api_models(srv)
    assert api[TEXT_MODEL]["vision"] is False and api[TEXT_MODEL]["vision_error"] is None
    # Not loaded yet: a linked projector counts.
    assert api[BROKEN]["vision"] is True and api[BROKEN]["mmproj"].endswith("mmproj-bad.gguf")
    # Loaded: the worker's word. The broken projector leaves text serving.
    text = _chat(client, [{"role": "user", "content": "hi"}], model=BROKEN)
    assert text.choices[0].message.content
    api = _api_models(srv)
    assert api[BROKEN]["vision"] is False and "projector" in api[BROKEN]["vision_error"]
    assert api[MODEL]["vision"] is True


# ------------------------------------------------------------------- chat


def test_images_steer_greedy_chat(client: openai.OpenAI) -> None:
    red = _chat(client, _look(RED))
    noise = _chat(client, _look(NOISE))
    again = _chat(client, _look(RED))
    text_only = _chat(client, [{"role": "user", "content": "look:  what is it?"}])
    key = (red.choices[0].message.content, red.usage.prompt_tokens)
    assert key != (noise.choices[0].message.content, noise.usage.prompt_tokens)
    assert key == (again.choices[0].message.content, again.usage.prompt_tokens)
    # One image is (32 / 8) ** 2 = 16 embeddings; the split text adds a few tokens.
    assert 16 <= red.usage.prompt_tokens - text_only.usage.prompt_tokens <= 16 + 4


def _look_as(image: bytes, media: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [
        {"type": "text", "text": "look: "}, {"type": "image_url", "image_url": {"url": data_url(image, media)}}]}]


def test_gif_images_reach_the_model(client: openai.OpenAI) -> None:
    first, second = gif(32, 32, (255, 0, 0), seed=1), gif(32, 32, (0, 255, 0), seed=2)
    a, b, again = (_chat(client, _look_as(g, "image/gif")) for g in (first, second, first))
    assert a.choices[0].message.content != b.choices[0].message.content
    assert a.choices[0].message.content == again.choices[0].message.content
    # As many image embeddings as a PNG of the same size.
    assert a.usage.prompt_tokens == _chat(client, _look_as(RED, "image/png")).usage.prompt_tokens


def test_webp_is_refused_by_name(client: openai.OpenAI) -> None:
    # The smallest lossless WebP (1x1): the engine's decoder does not read WebP.
    webp = base64.b64decode("UklGRhoAAABXRUJQVlA4TA0AAAAvAAAAEAcQERGIiP4HAA==")
    err = _bad(lambda: _chat(client, _chat_part(data_url(webp, "image/webp"))))
    assert err.param == "messages[0].content[1]" and err.code == "invalid_image"
    assert "WebP" in err.message and "PNG" in err.message


def test_streamed_chat_with_image(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=_look(RED),  # type: ignore[arg-type]
                                            temperature=0, max_tokens=10, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == _chat(client, _look(RED)).choices[0].message.content


def _bad(call: Any) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    assert info.value.status_code == 400
    return info.value


def _chat_part(url: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "x"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


@pytest.mark.parametrize(("url", "code"), [
    ("https://example.com/cat.png", "unsupported_image_url"),
    ("ftp://example.com/cat.png", "invalid_image_url"),
    ("data:image/png,notbase64", "invalid_image_url"),
    ("data:image/png;base64,@@@@not base64 at all", "invalid_image"),
    ("data:image/png;base64,iVBORw0KGgo=x", "invalid_image"),
    (data_url(b"just some text, not an image"), "invalid_image"),
    (data_url(b"BM" + b"\0" * 64, "image/bmp"), "invalid_image"),
    (data_url(RED, "image/tiff"), "invalid_image"),
    (data_url(RED[:8] + b"\0" * MAX_IMAGE_BYTES), "image_too_large"),
])
def test_bad_chat_images_are_400_naming_the_part(client: openai.OpenAI, url: str, code: str) -> None:
    err = _bad(lambda: _chat(client, _chat_part(url)))
    assert err.param == "messages[0].content[1]" and err.code == code


def test_corrupt_image_body_is_400_from_the_worker(client: openai.OpenAI) -> None:
    """A sound header, undecodable pixels (a GIF whose LZW code size is 13):
    only the engine's decoder can tell; still a 400 (the worker cannot name
    the part, so the messages). A broken header is the parent's 400 naming it."""
    corrupt = bytearray(gif(4, 4, (1, 2, 3)))
    corrupt[6 + 7 + 12 + 10] = 13  # after the screen, its 4-colour table and the frame descriptor
    err = _bad(lambda: _chat(client, _chat_part(data_url(bytes(corrupt), "image/gif"))))
    assert err.code == "invalid_image" and err.param == "messages"
    err = _bad(lambda: _chat(client, _chat_part(data_url(RED[:8] + b"\0" * 64))))
    assert err.code == "invalid_image" and err.param == "messages[0].content[1]" and "IHDR" in err.message


def test_image_count_and_total_are_bounded(client: openai.OpenAI) -> None:
    many = [{"type": "image_url", "image_url": {"url": data_url(RED)}}] * (MAX_IMAGES + 1)
    err = _bad(lambda: _chat(client, [{"role": "user", "content": many}]))
    assert err.param == f"messages[0].content[{MAX_IMAGES}]" and err.code == "too_many_images"
    # Each under the per-image bound (a sound 32x32 PNG padded with a text chunk), together over 12 MiB.
    text = b"Comment\0" + b"x" * (MAX_IMAGE_BYTES - 600_000)
    padding = struct.pack(">I", len(text)) + b"tEXt" + text + struct.pack(">I", zlib.crc32(b"tEXt" + text))
    big = data_url(RED[:33] + padding + RED[33:])  # after the signature and IHDR
    parts = [{"type": "text", "text": "x"}, *[{"type": "image_url", "image_url": {"url": big}}] * 4]
    err = _bad(lambda: _chat(client, [{"role": "user", "content": parts}]))
    assert err.param == "messages[0].content[4]" and err.code == "image_too_large"


def test_images_only_in_user_messages(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": data_url(RED)}}]},
                {"role": "user", "content": "hi"}]
    assert _bad(lambda: _chat(client, messages)).param == "messages[0].content[0]"


def test_image_to_a_model_without_vision(client: openai.OpenAI) -> None:
    err = _bad(lambda: _chat(client, _look(RED), model=TEXT_MODEL))
    assert err.param == "messages[0].content[1]" and err.code == "vision_unavailable"
    assert "projector" in err.message
    # Linked but failed to load: the worker's reason is in the message.
    _chat(client, [{"role": "user", "content": "hi"}], model=BROKEN)
    err = _bad(lambda: _chat(client, _look(RED), model=BROKEN))
    assert err.param == "messages[0].content[1]" and "not a projector" in err.message


# ------------------------------------------------------------------- responses


def _input(image: bytes, text: str = "look: ") -> list[dict[str, Any]]:
    return [{"role": "user", "content": [
        {"type": "input_text", "text": text},
        {"type": "input_image", "image_url": data_url(image), "detail": "auto"}]}]


def test_responses_with_typed_input_image(client: openai.OpenAI) -> None:
    red = client.responses.create(model=MODEL, input=_input(RED), temperature=0,  # type: ignore[arg-type]
                                  max_output_tokens=10)
    noise = client.responses.create(model=MODEL, input=_input(NOISE), temperature=0,  # type: ignore[arg-type]
                                    max_output_tokens=10)
    assert red.status == "incomplete" and red.output_text  # cut at max_output_tokens
    assert red.output_text != noise.output_text
    assert red.usage is not None and red.usage.input_tokens >= 16
    # Stored as sent: the input items give the image back.
    items = client.responses.input_items.list(red.id)
    part = items.data[0].content[1]  # type: ignore[union-attr]
    assert part.type == "input_image" and part.image_url == data_url(RED)


def test_continued_conversation_resends_earlier_images(client: openai.OpenAI) -> None:
    def turn(image: bytes) -> tuple[Any, Any]:
        first = client.responses.create(model=MODEL, input=_input(image), temperature=0,  # type: ignore[arg-type]
                                        max_output_tokens=4)
        second = client.responses.create(model=MODEL, previous_response_id=first.id, input="and now?",
                                         temperature=0, max_output_tokens=8)
        return first, second

    red1, red2 = turn(RED)
    noise1, noise2 = turn(NOISE)
    assert red2.status == "incomplete" and red2.error is None
    # The history's image is in the continued prompt (16 embeddings), and steers it.
    assert red2.usage.input_tokens >= red1.usage.input_tokens + red1.usage.output_tokens
    assert red2.output_text != noise2.output_text
    # A new image beside the earlier one: two, in order.
    third = client.responses.create(model=MODEL, previous_response_id=red1.id, input=_input(NOISE, "and: "),
                                    temperature=0, max_output_tokens=4)
    assert third.usage.input_tokens >= red1.usage.input_tokens + 16


def test_bad_response_images_are_400(client: openai.OpenAI) -> None:
    def create(content: list[dict[str, Any]], model: str = MODEL) -> Any:
        return client.responses.create(model=model, input=[{"role": "user", "content": content}],  # type: ignore[arg-type]
                                       max_output_tokens=4)

    text = {"type": "input_text", "text": "x"}
    err = _bad(lambda: create([text, {"type": "input_image", "file_id": "file-123", "detail": "auto"}]))
    assert err.param == "input[0].content[1]" and "not supported" in err.message
    err = _bad(lambda: create([text, {"type": "input_image", "image_url": "https://x/y.png", "detail": "auto"}]))
    assert err.param == "input[0].content[1]" and "remote image URLs are off" in err.message
    err = _bad(lambda: create([text, {"type": "input_image", "image_url": data_url(b"nope"), "detail": "auto"}]))
    assert err.param == "input[0].content[1]" and err.code == "invalid_image"
    err = _bad(lambda: create([text, {"type": "input_image", "image_url": data_url(RED), "detail": "auto"}],
                              model=TEXT_MODEL))
    assert err.param == "input[0].content[1]" and err.code == "vision_unavailable"


# ------------------------------------------------------------------- crash


def test_worker_crash_during_an_image_request(srv: Server, client: openai.OpenAI) -> None:
    """SIGKILL of the worker mid-stream: the stream's error object, then a restarted worker serves."""
    for _attempt in range(3):
        stream = client.chat.completions.create(
            model=MODEL, messages=_look(NOISE), temperature=0, max_tokens=1500,  # type: ignore[arg-type]
            stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        pid = int(srv.worker(MODEL)["pid"])
        os.kill(pid, signal.SIGKILL)
        try:
            for _ in chunks:
                pass
        except openai.APIError as exc:
            assert "crashed" in exc.message or "killed" in exc.message
            break
        # It finished before the kill landed: try again.
    else:
        pytest.fail("the worker finished before every kill")
    srv.wait_worker(lambda w: w["state"] == "ready" and w["pid"] != pid, model=MODEL)
    assert _chat(client, _look(RED)).choices[0].message.content


# ------------------------------------------------------------------- memory fit


def test_projector_counts_in_the_memory_estimate(tmp_path: Path) -> None:
    text, mmproj = write_tiny_vision_pair(tmp_path)
    entry = ModelEntry(id="tiny-vl", path=str(text), files=[str(text)], size_bytes=text.stat().st_size,
                       source="dir", root=str(tmp_path), mtime=0.0, mmproj=str(mmproj))
    assert projector_bytes(entry) == mmproj.stat().st_size + PROJECTOR_COMPUTE_ALLOWANCE
    assert projector_bytes(entry, embedding=True) == 0
    entry.mmproj = None
    assert projector_bytes(entry) == 0
