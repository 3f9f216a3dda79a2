"""How GGUF file names group into models: single files, shard sets, projectors.

Shared by the parent's model library and the download job, which lives in
the child package so that the job never imports parent code.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

SHARD_RE = re.compile(r"^(?P<base>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
_TEMP_SUFFIXES = (
    ".part",
    ".partial",
    ".tmp",
    ".temp",
    ".incomplete",
    ".download",
    ".crdownload",
    ".lock",
)



def is_temporary_name(name: str) -> bool:
    lower = name.lower()
    return name.startswith(".") or any(
        lower.endswith(s) or f"{s}." in lower for s in _TEMP_SUFFIXES
    )


def is_projector_name(name: str) -> bool:
    return "mmproj" in name.lower()


def model_stem(filename: str) -> str:
    """File name without folders, shard suffix and ``.gguf``."""
    name = filename.rsplit("/", 1)[-1]
    m = SHARD_RE.match(name)
    return (
        m.group("base") if m else name[: -len(".gguf")] if name.lower().endswith(".gguf") else name
    )


def hf_model_id(repo_id: str, filename: str) -> str:
    """The library id of a GGUF file (or shard set) in a hub repo."""
    return f"{repo_id}/{model_stem(filename)}"


def group_gguf_files(names: Iterable[str]) -> tuple[dict[str, list[str]], list[str]]:
    """Group GGUF file names (relative paths) into models.

    Returns (model key -> its files, shards in order; projector files). The
    key is the relative path without ``.gguf`` / shard suffix. A shard set
    missing shards maps to an empty list.
    """
    singles: dict[str, list[str]] = {}
    sets: dict[tuple[str, int], dict[int, str]] = {}
    projectors: list[str] = []
    for name in sorted(names):
        base = name.rsplit("/", 1)[-1]
        if not base.lower().endswith(".gguf") or is_temporary_name(base):
            continue
        if is_projector_name(base):
            projectors.append(name)
            continue
        m = SHARD_RE.match(base)
        if m is None:
            singles[name[: -len(".gguf")]] = [name]
            continue
        key = name[: len(name) - len(base)] + m.group("base")
        sets.setdefault((key, int(m.group("count"))), {})[int(m.group("no"))] = name
    for (key, count), shards in sets.items():
        complete = count > 0 and sorted(shards) == list(range(1, count + 1))
        singles[key] = [shards[i] for i in sorted(shards)] if complete else []
    return singles, projectors


def pick_projector(candidates: Sequence[str]) -> str | None:
    """Prefer an f16 projector, else the first by name."""
    if not candidates:
        return None
    f16 = [c for c in candidates if "f16" in c.lower()]
    return sorted(f16 or candidates)[0]
