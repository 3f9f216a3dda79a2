"""Checks on a request's images before they reach the engine.

The engine decodes images in native code and refuses what it cannot decode
with one generic message; checking the count, size and container format here
gives the parent a typed error for each case and keeps arbitrary bytes away
from the decoders. The format is told by magic bytes only: a file with a
valid header and a corrupt body is still refused by the engine, and
:mod:`worker.engine` reports that as ``invalid_image`` too.
"""

from __future__ import annotations

from worker.audio import AudioError, audio_format, check_audio
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


def image_format(data: bytes) -> str | None:
    """``png``, ``jpeg``, ``webp`` or ``gif`` from the magic bytes, else None."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if data.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if data.startswith((b"GIF87a", b"GIF89a")):
        return "gif"
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return None


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
            continue
        if audio_format(data) is None:
            raise ImageError("invalid_image", f"item {i} is not a PNG, JPEG or GIF image, nor WAV, MP3 or FLAC audio")
        if not audio:
            raise ImageError("audio_unavailable", f"this model takes no audio{reason}")
        try:
            check_audio(data)
        except AudioError as exc:
            raise ImageError("invalid_audio", f"audio {i}: {exc}") from exc
    placed = placements(req)
    if placed != len(req.images):
        raise ImageError("invalid_request",
                         f"the request places {placed} images but carries {len(req.images)}")
