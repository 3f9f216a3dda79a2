"""What a linked projector (mmproj) can take, read from its header: images,
audio, or both. Shown before the model loads; once its worker runs, what the
worker reports replaces it (supervisor/api/models.py)."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import NamedTuple

from formats.gguf_meta import GGUFMetaError, read_header


class Modalities(NamedTuple):
    vision: bool
    audio: bool


def projector_modalities(path: str) -> Modalities | None:
    """The encoders the projector file has; None when it cannot be read or is
    no projector at all (the worker then says why when it loads). Cached per
    file version."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _read(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=256)
def _read(path: str, _mtime_ns: int, _size: int) -> Modalities | None:
    try:
        meta, _ = read_header(Path(path))
    except (OSError, GGUFMetaError):
        return None
    if meta.get("general.architecture") != "clip":
        return None
    return Modalities(meta.get("clip.has_vision_encoder") is True, meta.get("clip.has_audio_encoder") is True)
