"""Audio in, through the model's audio projector: chat ``input_audio`` parts
with the official client, on a tiny random audio model the engine really runs.
Bad clips are 400s naming the part and never reach (or crash) the worker."""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator
from typing import Any, cast

import httpx
import openai
import pytest

from formats.audio import AudioError, check_audio
from tests.server import Server, running, short_tempdir
from tests.tiny_audio import audio_positions, wav, write_tiny_audio_pair
from tests.tiny_vision import write_tiny_text_model

MODEL = "tiny-audio"
TEXT_MODEL = "text/plain"


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    models = short_tempdir("gva")
    write_tiny_audio_pair(models)
    (models / "text").mkdir()
    write_tiny_text_model(models / "text" / "plain.gguf", seed=1)
    with running(Server(models, state_dir=short_tempdir(), model=MODEL, env={"GPUVISOR_N_CTX": "2048"})) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=120)


def _part(clip: bytes, fmt: str = "wav") -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(clip).decode(), "format": fmt}}


def _listen(clip: bytes, fmt: str = "wav") -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "listen: "}, _part(clip, fmt),
                                         {"type": "text", "text": " what is it?"}]}]


def _chat(client: openai.OpenAI, messages: list[dict[str, Any]], model: str = MODEL) -> Any:
    return client.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                          temperature=0, max_tokens=10)


def _bad(client: openai.OpenAI, messages: list[dict[str, Any]], model: str = MODEL) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, messages, model)
    return info.value


def _models(srv: Server, path: str) -> dict[str, dict[str, Any]]:
    return {m["id"]: m for m in httpx.get(srv.base_url + path, timeout=10).json()["data"]}


def test_models_say_audio_truthfully(srv: Server, client: openai.OpenAI) -> None:
    # Before it loads: read from the linked projector's header.
    before = _models(srv, "/api/models")[MODEL]
    assert before["audio"] is True and before["vision"] is False
    _chat(client, [{"role": "user", "content": "hi"}])
    for path in ("/v1/models", "/api/models"):
        listed = _models(srv, path)
        assert listed[MODEL]["audio"] is True and listed[MODEL]["vision"] is False
        assert listed[TEXT_MODEL]["audio"] is False


def test_audio_steers_greedy_chat_and_counts_in_usage(client: openai.OpenAI) -> None:
    tone, noise = wav(1.0, 440.0), wav(1.0, 0.0, seed=7)
    a, b, again = (_chat(client, _listen(clip)) for clip in (tone, noise, tone))
    text_only = _chat(client, [{"role": "user", "content": "listen:  what is it?"}])
    assert a.choices[0].message.content != b.choices[0].message.content
    assert a.choices[0].message.content == again.choices[0].message.content
    # The clip's embeddings are prompt tokens (plus the engine's begin/end markers).
    assert a.usage.prompt_tokens - text_only.usage.prompt_tokens >= audio_positions(16000)


def test_streamed_chat_with_audio(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=cast(Any, _listen(wav(0.5, 220.0))),
                                            temperature=0, max_tokens=10, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == _chat(client, _listen(wav(0.5, 220.0))).choices[0].message.content


def _one_sample_wav() -> bytes:
    return wav(1 / 16000, 440.0)


@pytest.mark.parametrize(("clip", "fmt", "param_suffix", "code"), [
    (b"not audio at all, just text", "wav", "", "invalid_audio"),
    (wav(0.2, 440.0), "ogg", ".input_audio.format", "invalid_audio"),
    (wav(0.2, 440.0), "mp3", "", "invalid_audio"),  # declared mp3, the bytes are a WAV
    (_one_sample_wav(), "wav", "", "invalid_audio"),  # one sample: aborted the engine
])
def test_bad_clips_are_400_naming_the_part(srv: Server, client: openai.OpenAI, clip: bytes, fmt: str,
                                           param_suffix: str, code: str) -> None:
    pid = srv.worker(MODEL)["pid"] if any(w["model"] == MODEL for w in srv.workers()) else None
    err = _bad(client, _listen(clip, fmt))
    assert err.code == code and err.param == "messages[0].content[1]" + param_suffix, err.body
    if pid is not None:
        assert srv.worker(MODEL)["pid"] == pid, "a bad clip reached and crashed the worker"


def test_undecodable_base64_and_roles(client: openai.OpenAI) -> None:
    bad = [{"role": "user", "content": [{"type": "input_audio",
                                         "input_audio": {"data": "@@not base64", "format": "wav"}}]}]
    err = _bad(client, bad)
    assert err.code == "invalid_audio" and err.param == "messages[0].content[0]"
    system: list[dict[str, Any]] = [{"role": "system", "content": [_part(wav(0.2, 440.0))]},
                                    {"role": "user", "content": "hi"}]
    assert _bad(client, system).param == "messages[0].content[0]"


def test_corrupt_body_with_a_wav_header_is_a_400_from_the_engine(srv: Server, client: openai.OpenAI) -> None:
    clip = bytearray(wav(0.3, 440.0))
    clip[20:22] = struct.pack("<H", 0x7777)  # an audio format code no decoder knows
    err = _bad(client, _listen(bytes(clip)))
    assert err.code == "invalid_audio" and err.param == "messages", err.body
    assert _chat(client, [{"role": "user", "content": "still there?"}]).choices


def test_audio_to_a_model_without_an_audio_projector(client: openai.OpenAI) -> None:
    err = _bad(client, _listen(wav(0.2, 440.0)), model=TEXT_MODEL)
    assert err.code == "audio_unavailable" and err.param == "messages[0].content[1]"
    assert "no audio projector" in err.message


def test_clip_length_is_read_from_the_header() -> None:
    assert check_audio(wav(0.2, 440.0)) == "wav"
    for short in (_one_sample_wav(), wav(2 / 48000, 440.0, sample_rate=48000)):
        with pytest.raises(AudioError, match="at least"):
            check_audio(short)
    # A FLAC's STREAMINFO: 16 kHz, mono, 16 bits, one sample in all.
    packed = (16000 << 44) | (0 << 41) | (15 << 36) | 1
    info = b"\x00" * 10 + packed.to_bytes(8, "big") + b"\x00" * 16
    with pytest.raises(AudioError, match="at least"):
        check_audio(b"fLaC" + b"\x80\x00\x00\x22" + info)
    with pytest.raises(AudioError, match="not FLAC"):
        check_audio(wav(0.2, 440.0), "flac")
