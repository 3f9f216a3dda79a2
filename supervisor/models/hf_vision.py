"""Whether a Hugging Face model (kind ``hf``) takes images, from its
``config.json`` alone, before any worker loads it.

A vision-language checkpoint declares its image tower in a ``vision_config``
beside the text model's config (BLIP-2, LLaVA, PaliGemma, Idefics3, Qwen-VL,
Gemma 3 and the others vLLM serves as multimodal). A checkpoint whose
architecture is a ``...ForCausalLM`` is its family's text model alone even
where the config keeps the tower's settings, so it counts as text only.

This is what the library can tell. Once its worker runs, what vLLM made of
the model replaces it (the worker's ``vision`` fact): vLLM's own build may
lack what a family's image processing needs (docs/vllm.md, Images).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from supervisor.models.hf_info import HfError, read_json

# config.json files are small; a bigger one is no config this module trusts.
MAX_CONFIG_BYTES = 4 << 20


def hf_takes_images(model_dir: str) -> bool:
    """True when ``model_dir``'s config.json declares a vision tower for a
    model that is not a text-only architecture. Cached per file version."""
    path = Path(model_dir) / "config.json"
    try:
        st = os.stat(path)
    except OSError:
        return False  # the library lists such a dir as unusable, with why
    return _read(str(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=256)
def _read(path: str, _mtime_ns: int, _size: int) -> bool:
    try:
        cfg = read_json(Path(path), MAX_CONFIG_BYTES)
    except HfError:
        # The library reads the same file and lists the model as unusable,
        # naming the fault; here it only means no images before a load.
        return False
    if not isinstance(cfg.get("vision_config"), dict):
        return False
    archs = cfg.get("architectures")
    names = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
    return bool(names) and not all(a.endswith("ForCausalLM") for a in names)
