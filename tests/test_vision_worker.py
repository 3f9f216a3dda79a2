"""Image input in a real worker: a tiny random model with a tiny projector."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from pathlib import Path

import msgspec
import pytest

from tests.tiny_vision import png, write_tiny_mmproj, write_tiny_vision_pair
from tests.worker_harness import Worker, spawn_worker
from worker import protocol as p

RED = png(32, 32, (255, 0, 0))
NOISE = png(40, 24, seed=3)


@pytest.fixture(scope="module")
def vision_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_tiny_vision_pair(tmp_path_factory.mktemp("vision"))


def _spawn(model: Path, mmproj: Path | None) -> AbstractAsyncContextManager[tuple[Worker, p.Ready]]:
    return spawn_worker(model, *(["--mmproj", str(mmproj)] if mmproj is not None else []))


def _chat(*parts: p.ContentPart) -> list[p.ChatMessage]:
    return [p.ChatMessage("user", parts=list(parts))]


async def test_images_steer_greedy_output_and_repeat_exactly(vision_pair: tuple[Path, Path]) -> None:
    model, mmproj = vision_pair
    async with _spawn(model, mmproj) as (w, hello):
        assert hello.facts.vision and hello.facts.vision_error == ""
        look = _chat(p.TextPart("look: "), p.ImagePart(), p.TextPart(" what is it?"))
        red_text, red = await w.generate(messages=look, images=[RED])
        noise_text, noise = await w.generate(messages=look, images=[NOISE])
        again_text, again = await w.generate(messages=look, images=[RED])
        assert isinstance(red, p.Done) and isinstance(noise, p.Done) and isinstance(again, p.Done)
        assert red.completion_tokens == 12 and red.finish_reason == "length"
        assert (red_text, red.prompt_tokens) != (noise_text, noise.prompt_tokens)
        assert again_text == red_text and again.prompt_tokens == red.prompt_tokens
        # One image is (32 / 8) ** 2 = 16 embeddings in the prompt's count;
        # the text around it is tokenized piecewise, a few tokens more than whole.
        text_only_text, text_only = await w.generate(messages=_chat(p.TextPart("look: "),
                                                                    p.TextPart(" what is it?")))
        assert isinstance(text_only, p.Done) and text_only_text
        assert 16 <= red.prompt_tokens - text_only.prompt_tokens <= 16 + 4
        # A raw prompt places images with MEDIA_MARKER.
        raw_text, raw = await w.generate(prompt=f"a {p.MEDIA_MARKER} b {p.MEDIA_MARKER} c", images=[RED, NOISE])
        assert isinstance(raw, p.Done) and raw.completion_tokens == 12


async def test_bad_images_get_typed_errors_and_the_worker_keeps_serving(
        vision_pair: tuple[Path, Path]) -> None:
    model, mmproj = vision_pair
    one = _chat(p.TextPart("x"), p.ImagePart())
    async with _spawn(model, mmproj) as (w, _):
        cases: list[tuple[dict[str, object], str]] = [
            ({"messages": one, "images": [b"this is not an image"]}, "invalid_image"),
            # Right magic bytes, undecodable body: refused by the engine's decoder.
            ({"messages": one, "images": [RED[:8] + b"\x00" * 64]}, "invalid_image"),
            ({"messages": one, "images": [b"\xff\xd8\xff" + b"\x00" * p.MAX_IMAGE_BYTES]}, "image_too_large"),
            ({"messages": _chat(*[p.ImagePart()] * (p.MAX_IMAGES + 1)),
              "images": [RED] * (p.MAX_IMAGES + 1)}, "too_many_images"),
            ({"messages": one, "images": [RED, RED]}, "invalid_request"),
            ({"messages": one}, "invalid_request"),
            # A prompt ending in an image would abort the engine.
            ({"prompt": f"x {p.MEDIA_MARKER}", "images": [RED]}, "invalid_request"),
        ]
        for fields, code in cases:
            _, end = await w.generate(**fields)
            assert isinstance(end, p.Error) and end.code == code, (code, end)
        text, done = await w.generate(messages=one, images=[RED])
        assert isinstance(done, p.Done) and text


async def test_cancel_stops_a_generation_with_images(vision_pair: tuple[Path, Path]) -> None:
    model, mmproj = vision_pair
    async with _spawn(model, mmproj) as (w, _):
        long = p.SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        w.writer.write(w.codec.encode(p.Generate(99, long, messages=_chat(p.ImagePart()), images=[RED])))
        assert isinstance(await w.next_msg(), p.Started)
        w.writer.write(w.codec.encode(p.Cancel(99)))
        while not isinstance(msg := await w.next_msg(), (p.Done, p.Error)):
            pass
        assert isinstance(msg, p.Done) and msg.finish_reason == "cancelled", msg
        assert msg.completion_tokens < 400
        _, done = await w.generate(messages=_chat(p.ImagePart()), images=[NOISE])
        assert isinstance(done, p.Done)


async def test_a_model_without_projector_refuses_images(vision_pair: tuple[Path, Path]) -> None:
    model, _ = vision_pair
    async with _spawn(model, None) as (w, hello):
        assert not hello.facts.vision and hello.facts.vision_error == ""
        _, end = await w.generate(messages=_chat(p.ImagePart()), images=[RED])
        assert isinstance(end, p.Error) and end.code == "vision_unavailable"
        # Text parts alone need no projector; a raw prompt's marker without images is text.
        _, done = await w.generate(messages=_chat(p.TextPart("hi")))
        assert isinstance(done, p.Done)
        _, done = await w.generate(prompt=f"hi {p.MEDIA_MARKER}")
        assert isinstance(done, p.Done)


@pytest.mark.parametrize("broken", ["width", "header", "garbage"])
async def test_a_projector_that_fails_to_load_leaves_text_serving(
        vision_pair: tuple[Path, Path], tmp_path: Path, broken: str) -> None:
    model, _ = vision_pair
    bad = tmp_path / f"mmproj-{broken}.gguf"
    if broken == "width":
        write_tiny_mmproj(bad, text_embd=32)  # output width unlike the model's 64: the engine refuses it
    elif broken == "header":
        # Without image normalisation the engine would abort the process; the worker checks first.
        good = write_tiny_mmproj(tmp_path / "good.gguf")
        bad.write_bytes(good.read_bytes().replace(b"clip.vision.image_mean", b"clip.vision.image_xxxx"))
    else:
        bad.write_bytes(b"GGUF" + b"\x00" * 64)
    async with _spawn(model, bad) as (w, hello):
        assert not hello.facts.vision
        assert bad.name in hello.facts.vision_error
        _, end = await w.generate(messages=_chat(p.ImagePart()), images=[RED])
        assert isinstance(end, p.Error) and end.code == "vision_unavailable"
        assert bad.name in end.message
        text, done = await w.generate(prompt="hello")
        assert isinstance(done, p.Done) and text


async def test_logprobs_and_grammars_work_with_images(vision_pair: tuple[Path, Path]) -> None:
    model, mmproj = vision_pair
    async with _spawn(model, mmproj) as (w, _):
        msgs = _chat(p.ImagePart(), p.TextPart(" describe"))
        text, done = await w.generate(messages=msgs, images=[RED],
                                      params=p.SamplingParams(max_tokens=4, temperature=0.0, logprobs=2))
        assert isinstance(done, p.Done) and done.completion_tokens == 4
        w.writer.write(w.codec.encode(p.Generate(50, p.SamplingParams(max_tokens=3, temperature=0.0, logprobs=2),
                                                 messages=msgs, images=[RED])))
        probs: list[p.TokenLogprob] = []
        while not isinstance(msg := await w.next_msg(), (p.Done, p.Error)):
            if isinstance(msg, p.Delta):
                probs += msg.logprobs or []
        assert len(probs) == 3 and all(len(t.top_logprobs) == 2 for t in probs)
        text, done = await w.generate(messages=msgs, images=[RED],
                                      params=p.SamplingParams(max_tokens=6, temperature=0.0,
                                                              grammar='root ::= "yes" | "no"'))
        assert isinstance(done, p.Done) and text in ("yes", "no")


def test_vision_fields_round_trip_and_default_for_old_peers() -> None:
    gen = p.Generate(1, messages=[p.ChatMessage("user", parts=[p.TextPart("a"), p.ImagePart()])], images=[RED])
    body = p.parent_codec().encode(gen)[4:]
    assert p.worker_codec().decode(body) == gen
    facts = p.ModelFacts("/m.gguf", 512, 2048, 300, True, False, vision=True, vision_error="")
    ready = p.Ready(facts)
    assert p.parent_codec().decode(p.worker_codec().encode(ready)[4:]) == ready
    # Facts from a worker that predates vision decode with vision off.
    old = msgspec.msgpack.encode({"type": "Ready", "facts": {
        "path": "/m.gguf", "n_ctx": 1, "n_ctx_train": 1, "n_vocab": 1, "has_chat_template": False,
        "embedding": False}})
    decoded = p.parent_codec().decode(old)
    assert decoded.facts.vision is False and decoded.facts.vision_error == ""
