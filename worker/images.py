"""Checks on a request's images before they reach the engine.

The engine decodes images in native code and refuses what it cannot decode
with one generic message; checking the count, size and container format here
gives the parent a typed error for each case and keeps arbitrary bytes away
from the decoders. The format is told by magic bytes only (formats/images.py,
formats/audio.py: the parent tells them the same way): a file with a valid
header and a corrupt body is still refused by the engine, and
:mod:`worker.refusal` reports that as ``invalid_image`` too.

The parent checks the same limits first (pixels per image and per request
from the image headers, clip lengths and sample rates from the audio
headers); this second check keeps a worker safe from any path that skipped
them, since a decompression bomb costs the worker, not the parent.
"""

from __future__ import annotations

from formats.audio import AudioError, AudioTooLong, audio_format, check_clip, check_request_seconds
from formats.images import ImageRefused, ImageTooLarge, check_image, check_request_pixels, image_format
from worker.protocol import (
    MAX_IMAGE_BYTES,
    MAX_IMAGES,
    MEDIA_MARKER,
    Error,
    Generate,
    ImagePart,
)


class ImageError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code

    def reply(self, req_id: int) -> Error:
        return Error(req_id, self.code, str(self))


def placements(req: Generate) -> int:
    """How many images the request's text places."""
    if req.messages is not None:
        return sum(isinstance(part, ImagePart) for m in req.messages for part in m.parts or [])
    return (req.prompt or "").count(MEDIA_MARKER)


def check_images(req: Generate, *, vision: bool, audio: bool, why: str = "") -> None:
    """Raise :class:`ImageError` for media the worker must not pass on: each
    item is an image (which needs ``vision``) or an audio clip (``audio``)."""
    if len(req.images) > MAX_IMAGES:
        raise ImageError("too_many_images", f"{len(req.images)} images; at most {MAX_IMAGES} per request")
    reason = f": {why}" if why else ""
    pixels, seconds = 0, 0.0
    for i, data in enumerate(req.images):
        if len(data) > MAX_IMAGE_BYTES:
            raise ImageError("image_too_large",
                             f"item {i} has {len(data)} bytes; at most {MAX_IMAGE_BYTES} per item")
        kind = image_format(data)
        if kind == "webp":
            raise ImageError("invalid_image", f"image {i} is WebP, which the engine does not decode")
        if kind is not None:
            if not vision:
                raise ImageError("vision_unavailable", f"this model takes no images{reason}")
            pixels += _image_pixels(i, data)
            continue
        if audio_format(data) is None:
            raise ImageError("invalid_image", f"item {i} is not a PNG, JPEG or GIF image, nor WAV, MP3 or FLAC audio")
        if not audio:
            raise ImageError("audio_unavailable", f"this model takes no audio{reason}")
        seconds += _clip_seconds(i, data)
    _check_totals(pixels, seconds)
    placed = placements(req)
    if placed != len(req.images):
        raise ImageError("invalid_request",
                         f"the request places {placed} images but carries {len(req.images)}")


def _image_pixels(i: int, data: bytes) -> int:
    try:
        return check_image(data).pixels
    except ImageTooLarge as exc:
        raise ImageError("image_too_large", f"image {i}: {exc}") from exc
    except ImageRefused as exc:
        raise ImageError("invalid_image", f"image {i}: {exc}") from exc


def _clip_seconds(i: int, data: bytes) -> float:
    try:
        return check_clip(data).seconds
    except AudioError as exc:
        raise ImageError("invalid_audio", f"audio {i}: {exc}") from exc


def _check_totals(pixels: int, seconds: float) -> None:
    try:
        check_request_pixels(pixels)
    except ImageTooLarge as exc:
        raise ImageError("image_too_large", str(exc)) from exc
    try:
        check_request_seconds(seconds)
    except AudioTooLong as exc:
        raise ImageError("invalid_audio", str(exc)) from exc
