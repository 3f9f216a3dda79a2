"""Image containers told by their magic bytes, and how many pixels they hold.

The parent checks a request's images with this before they travel, and a
worker checks them again before they reach the engine's decoder; both tell
the same formats the same way.

Pixel limits. The decoder (stb_image) allocates a whole canvas from the
header before it reads any image data, and the worker keeps every image of a
request decoded (RGB, 3 bytes a pixel) until its prompt is evaluated. Every
projector then resizes the picture down: fixed-size encoders to their
``clip.vision.image_size`` square (224 to 896 pixels a side), tiling and
dynamic-resolution ones to a few megapixels at most (Qwen2-VL's default
ceiling is 12.8 MP). So :data:`MAX_IMAGE_PIXELS` (50 MP, the largest phone
camera photos) refuses nothing a model could see, and with
:data:`MAX_REQUEST_PIXELS` it bounds a request's decoded images to about
300 MB (measured: a 64 MP GIF canvas cost a worker 370 MB).
"""

from __future__ import annotations

from formats.image_headers import (
    ImageRefused,
    ImageSize,
    ImageTooLarge,
    check_png_data,
    gif_size,
    jpeg_size,
    png_size,
)

__all__ = ["MAX_IMAGE_PIXELS", "MAX_REQUEST_PIXELS", "ImageRefused", "ImageSize", "ImageTooLarge",
           "check_image", "check_request_pixels", "image_format", "image_size"]

MAX_IMAGE_PIXELS = 50_000_000
MAX_REQUEST_PIXELS = 100_000_000


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


_READERS = {"png": png_size, "gif": gif_size, "jpeg": jpeg_size}


def image_size(data: bytes) -> ImageSize:
    """The image's dimensions from its header alone, within MAX_IMAGE_PIXELS;
    :class:`ImageRefused` (:class:`ImageTooLarge` over the limit) otherwise."""
    reader = _READERS.get(image_format(data) or "")
    if reader is None:
        raise ImageRefused("the image is not a PNG, JPEG or GIF file")
    size = reader(data)
    if size.pixels > MAX_IMAGE_PIXELS:
        raise ImageTooLarge(f"the image is {size.width}x{size.height} ({size.pixels / 1e6:.0f} MP); "
                            f"at most {MAX_IMAGE_PIXELS // 1_000_000} MP per image")
    return size


def check_image(data: bytes) -> ImageSize:
    """:func:`image_size`, and for a PNG its image data checked against it
    (inflated, bounded): what must hold before the engine decodes it."""
    size = image_size(data)
    if image_format(data) == "png":
        check_png_data(data)  # after the size check: an oversized image is not inflated
    return size


def check_request_pixels(total: int) -> None:
    """:class:`ImageTooLarge` when a request's images hold more than MAX_REQUEST_PIXELS."""
    if total > MAX_REQUEST_PIXELS:
        raise ImageTooLarge(f"the request's images hold {total / 1e6:.0f} MP; "
                            f"at most {MAX_REQUEST_PIXELS // 1_000_000} MP in one request")
