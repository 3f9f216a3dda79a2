"""Images in requests: ``data:`` URLs decoded and checked before a worker sees them.

Each image is decoded once, here, and refused with a 400 naming its field
(``messages[0].content[1]``, ``input[0].content[1]``) when it is not a data
URL, not base64, not a PNG, JPEG or GIF (by magic bytes, as the worker
tells them), or too large. WebP is refused by name: the engine's decoder
(stb_image) does not read it, and would refuse it with a generic message. A request's images all travel to the worker in
one IPC frame, so their total is bounded below the frame limit too.

Decompression bombs are refused here, from the headers, before any decoding
(formats/images.py, formats/audio.py say why the limits are what they are):
pixels per image and per request, and a PNG whose data inflates past its
stated size; a clip's length and sample rate, and the request's total
length. The worker checks the same again before its engine decodes.

Remote (``http(s)``) image URLs are refused: nothing here fetches them.
Fetching (with its own size, time and address limits) would need a setting
to turn it on; that is future work.
"""

from __future__ import annotations

import binascii
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from formats.audio import FORMATS as AUDIO_FORMATS
from formats.audio import AudioError, AudioTooLong, check_clip, check_request_seconds
from formats.images import (
    ImageRefused,
    ImageTooLarge,
    check_image,
    check_request_pixels,
    image_format,
    image_size,
)
from supervisor.errors import BadRequest
from worker.protocol import MAX_FRAME, MAX_IMAGE_BYTES, MAX_IMAGES, ModelFacts

# What a request's images may total: the frame also carries the messages,
# tools and template, so a quarter of it stays for them.
MAX_TOTAL_IMAGE_BYTES = MAX_FRAME * 3 // 4
# base64 text of the largest image allowed (4 chars per 3 bytes), plus slack
# for line breaks: anything longer is refused before it is decoded.
_MAX_B64_CHARS = (MAX_IMAGE_BYTES + 2) // 3 * 4 + 4096
_MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "gif": "image/gif"}


def _decode_base64(payload: str, param: str, what: str) -> bytes:
    """Strict base64 of at most MAX_IMAGE_BYTES; ``what`` names it in the
    message and the code (``invalid_image``, ``audio_too_large``, ...)."""
    if len(payload) > _MAX_B64_CHARS:
        raise BadRequest(f"the {what} is larger than {MAX_IMAGE_BYTES} bytes", param=param,
                         code=f"{what}_too_large")
    try:
        # Strict: trailing junk or stray characters are refused, not skipped.
        data = binascii.a2b_base64(payload, strict_mode=True)
    except (binascii.Error, ValueError) as exc:
        raise BadRequest(f"the {what} data is not valid base64: {exc}", param=param,
                         code=f"invalid_{what}") from exc
    if len(data) > MAX_IMAGE_BYTES:
        raise BadRequest(f"the {what} has {len(data)} bytes; at most {MAX_IMAGE_BYTES}", param=param,
                         code=f"{what}_too_large")
    return data


def decode_data_url(url: str, param: str) -> bytes:
    """The image bytes of a base64 ``data:`` URL; a 400 naming ``param`` otherwise."""
    scheme = url[:8].lower()
    if scheme.startswith(("http://", "https:/")):
        raise BadRequest("remote image URLs are off: send the image inline as a base64 data: URL",
                         param=param, code="unsupported_image_url")
    if not scheme.startswith("data:"):
        raise BadRequest("an image URL must be a base64 data: URL (data:image/png;base64,...)",
                         param=param, code="invalid_image_url")
    header, comma, payload = url.partition(",")
    if not comma or not header.lower().endswith(";base64"):
        raise BadRequest("an image data: URL must be base64 (data:image/png;base64,...)",
                         param=param, code="invalid_image_url")
    data = _decode_base64(payload, param, "image")
    kind = image_format(data)
    if kind == "webp":
        raise BadRequest("WebP images are not supported (the engine decodes PNG, JPEG and GIF): "
                         "convert it to PNG or JPEG", param=param, code="invalid_image")
    if kind is None:
        raise BadRequest("the image is not a PNG, JPEG or GIF file", param=param,
                         code="invalid_image")
    declared = header[5:].split(";", 1)[0].strip().lower()
    if declared and declared.startswith("image/") and declared not in _MEDIA_TYPES.values():
        raise BadRequest(f"unsupported image type {declared}; PNG, JPEG and GIF are",
                         param=param, code="invalid_image")
    with _refusals(param):
        check_image(data)
    return data


def decode_audio(data_b64: str, declared: str, param: str) -> bytes:
    """An ``input_audio`` part's clip: base64 WAV, MP3 or FLAC, long enough
    for the engine (see formats/audio.py); a 400 naming ``param`` otherwise."""
    fmt = declared.lower()
    if fmt not in AUDIO_FORMATS:
        raise BadRequest(f"unsupported audio format {declared!r}; wav, mp3 and flac are",
                         param=f"{param}.input_audio.format", code="invalid_audio")
    data = _decode_base64(data_b64, param, "audio")
    with _refusals(param):
        check_clip(data, fmt)
    return data


@contextmanager
def _refusals(param: str) -> Iterator[None]:
    """The media checks' refusals as 400s naming ``param``."""
    try:
        yield
    except ImageTooLarge as exc:
        raise BadRequest(str(exc), param=param, code="image_too_large") from exc
    except ImageRefused as exc:
        raise BadRequest(str(exc), param=param, code="invalid_image") from exc
    except AudioTooLong as exc:
        raise BadRequest(str(exc), param=param, code="audio_too_long") from exc
    except AudioError as exc:
        raise BadRequest(str(exc), param=param, code="invalid_audio") from exc


@dataclass
class Images:
    """A request's media (images and audio clips) in the order their parts
    place them: they travel to the worker as one list."""

    data: list[bytes] = field(default_factory=list)
    # The field of each item, for errors raised after collection (no vision).
    params: list[str] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)  # "image" or "audio"
    total: int = 0
    pixels: int = 0  # of every image, from their headers
    seconds: float = 0.0  # of every clip

    def add(self, url: str, param: str) -> None:
        if len(self.data) >= MAX_IMAGES:
            raise BadRequest(f"more than {MAX_IMAGES} images in one request", param=param,
                             code="too_many_images")
        data = decode_data_url(url, param)
        self.add_decoded(data, param)

    def add_audio(self, data_b64: str, declared: str, param: str) -> None:
        if len(self.data) >= MAX_IMAGES:
            raise BadRequest(f"more than {MAX_IMAGES} images and clips in one request", param=param,
                             code="too_many_images")
        self.add_decoded(decode_audio(data_b64, declared, param), param, "audio")

    def add_decoded(self, data: bytes, param: str, kind: str = "image") -> None:
        if len(self.data) >= MAX_IMAGES:
            raise BadRequest(f"more than {MAX_IMAGES} images in one request", param=param,
                             code="too_many_images")
        if self.total + len(data) > MAX_TOTAL_IMAGE_BYTES:
            raise BadRequest(f"the request's images total more than {MAX_TOTAL_IMAGE_BYTES} bytes",
                             param=param, code="image_too_large")
        # Headers only (checked whole when decoded); stored history is counted too.
        with _refusals(param):
            if kind == "audio":
                self.seconds += check_clip(data).seconds
                check_request_seconds(self.seconds)
            else:
                self.pixels += image_size(data).pixels
                check_request_pixels(self.pixels)
        self.data.append(data)
        self.params.append(param)
        self.kinds.append(kind)
        self.total += len(data)

    def first(self, kind: str) -> str | None:
        """The field of the first item of ``kind``, None without one."""
        return next((p for p, k in zip(self.params, self.kinds, strict=True) if k == kind), None)


def no_vision_message(model: str, vision_error: str = "") -> str:
    text = f"model '{model}' takes no images: it has no vision projector (mmproj) loaded"
    return f"{text} ({vision_error})" if vision_error else text


def no_audio_message(model: str, why: str = "") -> str:
    text = f"model '{model}' takes no audio: it has no audio projector (mmproj) loaded"
    return f"{text} ({why})" if why else text


def require_media(model: str, images: Images, vision: bool, audio: bool, why: str = "") -> None:
    """A 400 naming the first image (or clip) the model cannot take."""
    image_at, audio_at = images.first("image"), images.first("audio")
    if image_at is not None and not vision:
        raise BadRequest(no_vision_message(model, why), param=image_at, code="vision_unavailable")
    if audio_at is not None and not audio:
        raise BadRequest(no_audio_message(model, why), param=audio_at, code="audio_unavailable")


def require_vision(model: str, images: Images, facts: ModelFacts) -> None:
    """A 400 naming the first item the loaded model cannot take."""
    require_media(model, images, facts.vision, facts.audio, facts.vision_error)
