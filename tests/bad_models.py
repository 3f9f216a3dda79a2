"""Model files that pass the library's header checks and fail only in the
engine: what a worker-side load failure (exit 3, no restart) needs now that
the library refuses unreadable headers before any worker starts."""

from __future__ import annotations

import struct
from pathlib import Path

from supervisor.models.demo import write_tiny_gguf

_ARCH_KEY = b"general.architecture" + struct.pack("<IQ", 8, 5)


def engine_refused_gguf(path: Path) -> Path:
    """A tiny model whose architecture ("llamz") the engine does not know."""
    real = write_tiny_gguf(path.with_name(path.name + ".src")).read_bytes()
    path.with_name(path.name + ".src").unlink()
    path.write_bytes(real.replace(_ARCH_KEY + b"llama", _ARCH_KEY + b"llamz", 1))
    return path
